#!/usr/bin/env python
"""A random-weight mixture of experts of realistic proportions, built the way llama.cpp users get
one (transformers checkpoint → ``convert_hf_to_gguf.py`` → ``llama-quantize``), then minirt vs
llama.cpp on it with ``bench/compare.py`` (decode and prefill, side by side in one run).

    # build (needs a Python with torch + transformers + gguf-py: --ref-python), then compare
    python bench/moe.py --llama-cpp /path/to/llama.cpp --ref-python /path/to/torch-venv/bin/python
    python bench/moe.py ... --tiny --quick --llama-repack 0 -- -t 2 -p 32 -g 8   # smoke run: a few-MB model

The default shape is a Qwen3-MoE (``qwen3moe``) with hidden 2048, 16 layers, 32 experts of width
768, top-4, 16 query / 4 KV heads of 128: 2.7 B parameters, about 1.6 GB at Q4_K_M. ``--shape
lfm2-350m`` builds an LFM2 of LFM2-350M's proportions instead (the short-convolution hybrid), ``qwen35-0.8b`` a
Qwen3.5 and ``granite-4.0-h-350m`` a Granite 4.0-H (the Mamba-2 hybrid) of those models' proportions,
``gemma4-26b-a4b-mini`` a Gemma 4 MoE of 26B-A4B's layer proportions (fewer layers and experts). Weights are
N(0, 0.02), seeded; the router is scaled so that routing is decisive. The files are cached in
``--work`` (made once per shape). Everything after ``--`` goes to bench/compare.py.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_QWEN3MOE = dict(config="Qwen3MoeConfig", model="Qwen3MoeForCausalLM", tied=False,
                 extra=dict(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], rms_norm_eps=1e-6))
_LFM2 = dict(config="Lfm2Config", model="Lfm2ForCausalLM", tied=True,
             extra=dict(norm_eps=1e-5, conv_L_cache=3, conv_bias=False, block_auto_adjust_ff_dim=True,
                        block_multiple_of=256, block_ffn_dim_multiplier=1.0))
_QWEN35 = dict(config="Qwen3_5TextConfig", model="Qwen3_5ForCausalLM", tied=True, convert_args=["--no-mtp"],
               extra=dict(rms_norm_eps=1e-6, linear_conv_kernel_dim=4),
               rope={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True})
# Granite 4.0-H (Mamba-2 + attention); transformers 5 saves the layer types under other names than the
# released checkpoints (and the converter) use
_GRANITEH = dict(config="GraniteMoeHybridConfig", model="GraniteMoeHybridForCausalLM", tied=True,
                 layer_type_names={"linear_attention": "mamba", "full_attention": "attention"}, router="router.layer",
                 extra=dict(rms_norm_eps=1e-5, position_embedding_type=None, mamba_d_conv=4, mamba_expand=2,
                            mamba_conv_bias=True, mamba_proj_bias=False, embedding_multiplier=12.0,
                            residual_multiplier=0.246, attention_multiplier=0.0078125, logits_scaling=4.0))
# gpt-oss: attention sinks, sliding window on every other layer, YaRN, biased experts with clamped SwiGLU
_GPTOSS = dict(config="GptOssConfig", model="GptOssForCausalLM", tied=False, router="mlp.router",
               extra=dict(rms_norm_eps=1e-5, sliding_window=128, swiglu_limit=7.0),
               rope={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                     "original_max_position_embeddings": 4096, "rope_theta": 150000.0})
# Gemma 4 MoE (26B-A4B): a dense GeGLU MLP beside the experts in every layer, sliding / global attention; the
# router reads the RMS-normed residual times a scale vector and d^-0.5, so its weights need a larger spread
# for decisive routing; SentencePiece-style tokenizer (the converter reads it through LlamaHfVocab)
_GEMMA4 = dict(config="Gemma4TextConfig", model="Gemma4ForCausalLM", tied=True, tokenizer="hf_spm",
               router="router.proj", router_sd=3.0,
               extra=dict(rms_norm_eps=1e-6, sliding_window=1024, final_logit_softcapping=30.0,
                          hidden_activation="gelu_pytorch_tanh", hidden_size_per_layer_input=0, num_kv_shared_layers=0,
                          attention_k_eq_v=False, enable_moe_block=True),
               rope={"full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                        "rope_theta": 1000000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
# name -> (family, transformers config sizes)
SHAPES = {
    "default": (_QWEN3MOE, dict(hidden_size=2048, num_hidden_layers=16, num_experts=32, num_experts_per_tok=4,
                                moe_intermediate_size=768, intermediate_size=6144, num_attention_heads=16,
                                num_key_value_heads=4, head_dim=128)),
    "tiny": (_QWEN3MOE, dict(hidden_size=256, num_hidden_layers=2, num_experts=16, num_experts_per_tok=2,
                             moe_intermediate_size=256, intermediate_size=512, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=64)),
    # LFM2-350M's proportions (the hybrid of issue 17): 10 short-convolution and 6 attention layers,
    # FFN 6656 auto-adjusted to 4608 as the released model has it
    "lfm2-350m": (_LFM2, dict(hidden_size=1024, num_hidden_layers=16, intermediate_size=6656, num_attention_heads=16,
                              num_key_value_heads=8,
                              layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention",
                                           "conv", "conv", "full_attention", "conv", "full_attention", "conv",
                                           "full_attention", "conv", "full_attention", "conv"])),
    # Qwen3.5-0.8B's proportions (the delta-net hybrid of issue 17): 18 gated delta-net layers (16 key and
    # 16 value heads of 128) and 6 gated attention layers (8 query / 2 KV heads of 256), FFN 3584
    "qwen35-0.8b": (_QWEN35, dict(hidden_size=1024, num_hidden_layers=24, intermediate_size=3584,
                                  num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                                  linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                                  linear_num_value_heads=16,
                                  layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6)),
    # Granite-4.0-H-350M's proportions (the Mamba-2 hybrid of issue 17): 28 Mamba-2 layers (48 heads of 32, state
    # 128, 1 group) and 4 attention layers (12 query / 4 KV heads of 64, no RoPE), dense SwiGLU FFN 2048
    "granite-4.0-h-350m": (_GRANITEH, dict(hidden_size=768, num_hidden_layers=32, intermediate_size=2048,
                                           shared_intermediate_size=2048, num_local_experts=0, num_experts_per_tok=0,
                                           num_attention_heads=12, num_key_value_heads=4, mamba_n_heads=48,
                                           mamba_d_head=32, mamba_d_state=128, mamba_n_groups=1,
                                           layer_types=["attention" if i in (7, 15, 23, 31) else "mamba"
                                                        for i in range(32)])),
    # gpt-oss-20b's layout at a third of its width: 12 layers alternating sliding (128) and full attention (16
    # query / 4 KV heads of 64, sinks), 32 experts of 1024 top-4 with biases: 1.3 B parameters, about 0.75 GB
    # with --quant MXFP4_MOE (as gpt-oss ships)
    "gpt-oss-mini": (_GPTOSS, dict(hidden_size=1024, num_hidden_layers=12, num_local_experts=32, num_experts_per_tok=4,
                                   intermediate_size=1024, num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                                   layer_types=["sliding_attention", "full_attention"] * 6)),
    # Gemma 4 26B-A4B's layer proportions (hidden 2816, 16 query / 8 KV heads of 256 on sliding layers, 512 on the
    # global ones, 5 sliding : 1 global, a dense GeGLU MLP of 2112 beside experts of 704, top-8) with 12 of its 30
    # layers and 32 of its 128 experts: 2.6 B parameters, about 1.5 GB at Q4_K_M
    "gemma4-26b-a4b-mini": (_GEMMA4, dict(hidden_size=2816, num_hidden_layers=12, intermediate_size=2112,
                                          num_attention_heads=16, num_key_value_heads=8, head_dim=256,
                                          global_head_dim=512, num_experts=32, top_k_experts=8,
                                          moe_intermediate_size=704,
                                          layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 2)),
}

# Run by --ref-python: writes a seeded random checkpoint of the shape's family (bfloat16, parameters
# filled one at a time so that memory stays near one copy) with a tiny byte-level BPE tokenizer.
_BUILD = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[1])
import torch, transformers
from make_fixtures import GEMMA_SPECIALS, write_bpe, write_hf_spm
out, shape, seed, fam = Path(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), json.loads(sys.argv[5])
out.mkdir(parents=True, exist_ok=True)
if fam.get("tokenizer") == "hf_spm":
    write_hf_spm(out, 512, GEMMA_SPECIALS)
    specials = GEMMA_SPECIALS
else:
    specials = write_bpe(out, 512)
cfg = getattr(transformers, fam["config"])(vocab_size=512, max_position_embeddings=32768,
                                            tie_word_embeddings=fam["tied"], bos_token_id=specials["bos"],
                                            eos_token_id=specials["eos"], pad_token_id=specials["pad"],
                                            rope_parameters=fam.get("rope", {"rope_type": "default",
                                                                             "rope_theta": 1000000.0}),
                                            **fam["extra"], **shape)
torch.manual_seed(seed)
with torch.device("meta"):
    model = getattr(transformers, fam["model"])(cfg)
model = model.to_empty(device="cpu").to(torch.bfloat16)
gen = torch.Generator().manual_seed(seed)
with torch.no_grad():
    for name, p in sorted(model.named_parameters()):
        if p.ndim >= 2:
            router = fam.get("router", "mlp.gate") + ".weight" in name
            p.copy_(torch.randn(p.shape, generator=gen) * (fam.get("router_sd", 0.16) if router else 0.02))
        else:
            p.fill_(1.0)
model.save_pretrained(str(out), safe_serialization=True)
names = fam.get("layer_type_names")
if names:
    c = json.loads((out / "config.json").read_text())
    c["layer_types"] = [names.get(t, t) for t in c["layer_types"]]
    (out / "config.json").write_text(json.dumps(c, indent=2))
"""


def run(cmd: list[str], what: str) -> None:
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"{what} failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-4000:]}")


def build(args: argparse.Namespace) -> Path:
    """The Q4_K_M (``--quant``) GGUF of the chosen shape, made once in ``--work``."""
    tag = "tiny" if args.tiny else args.shape
    fam, shape = SHAPES[tag]
    work = Path(args.work) / (f"qwen3moe-{tag}-s{args.seed}" if fam is _QWEN3MOE else f"{tag}-s{args.seed}")
    gguf = work / f"model-{args.quant.lower()}.gguf"
    if gguf.is_file():
        return gguf
    hf, f16 = work / "hf", work / "model-bf16.gguf"
    llama = Path(args.llama_cpp)
    print(f"building {tag} ({fam['model']}) in {work} ...", flush=True)
    run([args.ref_python, "-c", _BUILD, str(ROOT / "tools" / "arch_fixtures"), str(hf), json.dumps(shape),
         str(args.seed), json.dumps(fam)], "building the checkpoint")
    # the tiny vocabulary matches no known pre-tokenizer hash: name one (as tools/arch_fixtures does)
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("make_fixtures", ROOT / "tools" / "arch_fixtures" / "make_fixtures.py")
    mf = module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mf)
    run([args.ref_python, "-c", mf._CONVERT, str(llama), "qwen2", str(hf), "--outtype", "bf16", "--outfile", str(f16),
         *fam.get("convert_args", [])], "convert_hf_to_gguf.py")
    run([str(Path(args.bin or llama / "build" / "bin") / "llama-quantize"), str(f16), str(gguf), args.quant.upper()],
        "llama-quantize")
    if not args.keep:
        f16.unlink()
        import shutil

        shutil.rmtree(hf, ignore_errors=True)
    return gguf


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rest: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, rest = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--llama-cpp", required=True, help="llama.cpp source tree (convert_hf_to_gguf.py, build/bin)")
    ap.add_argument("--bin", help="directory with llama-quantize and llama-bench (default <llama-cpp>/build/bin)")
    ap.add_argument("--ref-python", required=True, help="Python with torch, transformers and gguf-py")
    ap.add_argument("--work", default=str(Path.home() / ".cache" / "minirt" / "bench-moe"))
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tiny", action="store_true", help="a few-MB model (smoke runs)")
    ap.add_argument("--shape", choices=sorted(k for k in SHAPES if k != "tiny"), default="default",
                    help="default: the Qwen3-MoE below; lfm2-350m: LFM2-350M's proportions (a hybrid)")
    ap.add_argument("--quick", action="store_true", help="bench/compare.py --quick")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint and the bf16 GGUF")
    ap.add_argument("--build-only", action="store_true")
    ap.add_argument("--llama-repack", type=int, choices=[0, 1], default=1,
                    help="llama-bench --repack (0: no CPU weight repacking; it crashes on the --tiny shapes)")
    args = ap.parse_args(argv)
    gguf = build(args)
    print(f"model: {gguf} ({gguf.stat().st_size / 1e9:.2f} GB)", flush=True)
    if args.build_only:
        return 0
    sys.path.insert(0, str(ROOT / "bench"))
    import compare

    bench_bin = Path(args.bin or Path(args.llama_cpp) / "build" / "bin") / "llama-bench"
    if not args.llama_repack:  # bench/compare.py runs the binary it is given: one that adds the flag
        wrapper = gguf.parent / "llama-bench-norepack"
        wrapper.write_text(f'#!/bin/sh\nexec "{bench_bin}" "$@" --repack 0\n')
        wrapper.chmod(0o755)
        bench_bin = wrapper
    cargs = ["-m", str(gguf), "--llama-bench", str(bench_bin)] + (["--quick"] if args.quick else []) + rest
    return compare.run(cargs)


if __name__ == "__main__":
    sys.exit(main())
