"""A real-size embedding GGUF with random weights, for ``bench/embeddings.py`` (nothing downloaded).

The tiny fixtures in ``tests/data/embed`` time per-call overhead, not the encoder's matmuls and
attention. This writes a BertModel with bge-small-en-v1.5's shape (hidden 384, 12 layers, 12 heads,
FFN 1536, 512 positions, WordPiece vocabulary of 30,522 entries: BERT's special tokens, the
benchmark's words, single characters and their ``##`` forms, then filler entries), initialised
like the fixtures (seeded), with sentence-transformers' mean pooling, converted by llama.cpp's own
``convert_hf_to_gguf.py --outtype f16`` and quantized to Q8_0 by ``llama-quantize``.

    PYTHONPATH=$LCP LLAMA_CPP_LIB_PATH=$LCP/vendor/llama.cpp/build/bin \\
      python tools/embed_fixtures/make_bench_model.py --llama-cpp $LCP/vendor/llama.cpp --out /tmp/bge-small-random

Same environment as ``make_fixtures.py`` (torch, transformers, the vendored llama.cpp tree).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

VOCAB = 30522
BGE_SMALL = dict(vocab_size=VOCAB, hidden_size=384, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=1536, max_position_embeddings=512, type_vocab_size=2, hidden_act="gelu",
                 layer_norm_eps=1e-12, pad_token_id=0)


def write_vocab(out: Path, words: list[str]) -> None:
    from transformers import BertTokenizerFast

    toks = ["[PAD]"] + [f"[unused{i}]" for i in range(1, 100)] + ["[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    chars = [chr(c) for c in range(33, 127)] + [chr(c) for c in range(0xC0, 0x180)]
    toks += chars + ["##" + c for c in chars]
    toks += [w for w in dict.fromkeys(words) if w not in toks]
    toks += [f"w{i:05d}" for i in range(VOCAB - len(toks))]
    (out / "vocab.txt").write_text("\n".join(toks) + "\n", encoding="utf-8")
    BertTokenizerFast(vocab_file=str(out / "vocab.txt")).save_pretrained(str(out))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llama-cpp", type=Path, required=True, help="the llama.cpp tree (with build/bin)")
    ap.add_argument("--out", type=Path, required=True, help="folder for model-f16.gguf and model-q8_0.gguf")
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)

    import make_fixtures as mf  # the fixtures' converter wrapper, weight init and sentence-transformers files
    import torch
    import transformers

    bench_words = (HERE.parents[1] / "bench" / "embeddings.py").read_text()
    start = bench_words.index("WORDS = (") + len("WORDS = (")
    words = " ".join(s.strip().strip('"') for s in bench_words[start:bench_words.index(").split()", start)]
                     .splitlines()).split()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as td:
        hf = Path(td) / "bge-small-random"
        hf.mkdir()
        write_vocab(hf, words)
        config = transformers.BertConfig(**BGE_SMALL)
        torch.manual_seed(args.seed)
        model = transformers.BertModel(config).to(torch.float32)
        mf.af.reinit(model, args.seed)
        model.save_pretrained(str(hf), safe_serialization=True)
        mf.write_st_modules(hf, "mean", (), model, args.seed)
        f16 = args.out / "model-f16.gguf"
        mf.convert(args.llama_cpp, hf, f16, "default", False)  # as the bert fixture (hash of a made-up vocabulary)
        mf.af.quantize(args.llama_cpp / "build" / "bin", f16, args.out / "model-q8_0.gguf", "q8_0")
    print(json.dumps({"out": str(args.out), "words": len(words)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
