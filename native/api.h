/* Public C API of the minirt native kernels (also the cffi cdef: keep it free of preprocessor lines).
 *
 * Conventions: row-major float32 arrays; strides are in elements; every pointer is owned by the caller.
 * Weights are ggml blocks, `rows` rows of `row_bytes` bytes each. Return codes: 0 = ok, < 0 = error
 * (MR_E_* below); the Python wrapper validates everything first, so errors here are a second line. */

enum {
    MR_ISA_SCALAR = 0, MR_ISA_AVX2 = 1, MR_ISA_AVX512 = 2, MR_ISA_NEON = 3, MR_ISA_NEON_DOT = 4,
    MR_ISA_AVX512_AMX = 5, MR_N_ISA = 6
};

enum {
    MR_OK = 0, MR_E_QTYPE = -1, MR_E_SHAPE = -2, MR_E_ISA = -3, MR_E_NOMEM = -4, MR_E_THREADS = -5
};

/* ISA: what this CPU supports (bitmask of 1 << MR_ISA_*), the selected one, and a forced one. */
int mr_isa_mask(void);
int mr_isa_selected(void);
int mr_set_isa(int isa);              /* -1: best supported; returns MR_E_ISA when not supported */

/* Threads: the persistent pool. */
int mr_physical_cores(void);
int mr_get_threads(void);
int mr_set_threads(int n);            /* default number of threads for calls that pass threads <= 0 */

/* Y[t, r] = sum_c X[t, c] * W[r, c]  for t < n_tokens, r < rows.
 * qtype: ggml type id. isa: -1 = the selected one. threads: <= 0 = the default.
 * Returns < 0 on error, else the number of row chunks the caller recomputed because a worker was
 * descheduled: when > 0, that worker may still read w and x for a while, so keep them alive until
 * mr_pool_quiescent(mr_pool_generation()) returns 1. */
int mr_matmul(int qtype, const unsigned char *w, long long rows, long long cols, long long row_bytes,
              const float *x, long long n_tokens, long long x_stride,
              float *y, long long y_stride, int threads, int isa);

/* Packed weights ("P4" layout, see pack.c): the same bytes reordered for the decode kernels.
 * mr_pack_size: bytes of the packed matrix, 0 when (qtype, cols) cannot be packed. mr_pack writes
 * it, mr_unpack restores the ggml rows (row_bytes apart). mr_matmul_packed is mr_matmul over a
 * packed matrix (same return convention). */
long long mr_pack_size(int qtype, long long rows, long long cols);
int mr_pack(int qtype, const unsigned char *w, long long rows, long long cols, long long row_bytes,
            unsigned char *dst, int threads);
int mr_unpack(int qtype, const unsigned char *src, long long rows, long long cols, unsigned char *w,
              long long row_bytes);
/* Rows ids[0..n) of a packed matrix dequantized to float32 (n x cols), as mr_dequantize gives them. */
int mr_pack_rows(int qtype, const unsigned char *src, long long rows, long long cols, const long long *ids,
                 long long n, float *out);
int mr_matmul_packed(int qtype, const unsigned char *wp, long long rows, long long cols,
                     const float *x, long long n_tokens, long long x_stride,
                     float *y, long long y_stride, int threads, int isa);
/* 1 when `isa` has integer kernels for packed matrices of qtype (packing pays off), else 0. */
int mr_pack_preferred(int qtype, int isa);
/* Which path mr_matmul_packed takes: 1 = integer, 3 = float tile, 4 = float panel, 2 = float dots. */
int mr_matmul_packed_path(int qtype, long long n_tokens, int isa);

/* Native decoder layers for decode steps (one new token per sequence), see layer.c. */
typedef struct {
    int qtype;                  /* ggml type id */
    int packed;                 /* 1: data was written by mr_pack */
    const unsigned char *data;
    long long rows, cols, row_bytes;
    const float *bias;          /* (rows,) or NULL */
} mr_weight;

/* A mixture-of-experts feed-forward in the layer stack (mr_layer.moe): router (n_expert, n_embd) with its bias;
 * gating 0 softmax over all experts, 1 sigmoid of each, 2 softmax over the chosen logits; the top n_used by
 * probability plus sel_bias (or NULL) are chosen (ties: lower id first), their probabilities renormalised to
 * sum 1 (norm_topk) and multiplied by scale. Experts as mr_moe_experts takes them (gate NULL: down(act(up x));
 * act 0 SiLU, 1 GELU (tanh), 3 clamped SwiGLU, 4 squared ReLU without gate). Shared expert: sh_up.data NULL
 * for none, sh_gate.data NULL without gate (sh_act 0 SiLU, 1 GELU, 4 squared ReLU), sh_inp (1, n_embd) a
 * sigmoid gate of its output or data NULL. */
typedef struct {
    long long n_expert, n_used;
    int gating, norm_topk;
    float scale;
    const float *sel_bias;
    mr_weight router;
    const mr_weight *gate, *up, *down;
    int act;
    float alpha, limit;
    mr_weight sh_gate, sh_up, sh_down, sh_inp;
    int sh_act;
    const float *expert_scale;  /* (n_expert) or NULL: a chosen expert's weight is multiplied by its entry (Gemma 4) */
} mr_moe;

typedef struct {
    long long n_embd, n_ff, n_head, n_head_kv, head_dim_k, head_dim_v, rope_dim; /* n_ff 0: no feed-forward
                                   half (gate, up, down NULL; a Nemotron-H mixer followed by another mixer) */
    float eps, attn_scale, softcap;
    float residual_scale;       /* x += residual_scale * block output (Granite); 1 otherwise */
    long long window;           /* > 0: each query sees only the last `window` positions */
    int rope_neox, act;         /* act: 0 SiLU, 1 GELU (tanh) gated; 2 xIELU, 3 squared ReLU without gate */
    int rope_table;             /* index of this layer's cos/sin table pair; -1: no RoPE (NoPE layer) */
    int norm_kind;              /* attn/ffn/post norms: 0 RMSNorm, 1 LayerNorm (with optional biases) */
    int qk_norm_full;           /* q/k norms over the whole projection (H*D) instead of each head */
    int parallel;               /* x += attn(n(x)) + mlp(n(x)) with the one attn_norm (Cohere) */
    int qk_norm_after_rope;     /* q/k norms applied to the rotated q/k (HunYuan) */
    float act_params[4];        /* act 2 (xIELU, MLP without gate: gate.data NULL): alpha_n, alpha_p, beta, eps */
    const float *attn_norm, *q_norm, *k_norm, *post_attn_norm, *ffn_norm, *post_ffn_norm; /* NULL: none */
    const float *attn_norm_b, *ffn_norm_b; /* LayerNorm biases or NULL */
    mr_weight wq, wk, wv, wo, gate, up, down;
    long long kv_layer;         /* -1: own K/V; else the earlier layer whose cache this one reads (wk, wv unused) */
    int v_norm;                 /* 1: values RMS-normed per head, without gains, before they are stored (Gemma 4) */
    float out_scale;            /* the block's output x is multiplied by it (Gemma 4's layer_output_scale); 1 otherwise */
    long long n_pl;             /* > 0: per-layer input of that width (Gemma 4), after the MLP residual:
                                   x += pl_post_norm(pl_proj(act_pl(pl_gate x) * in_l)) */
    int pl_act;                 /* its activation: 0 SiLU, 1 GELU (tanh) */
    mr_weight pl_gate, pl_proj; /* (n_pl, n_embd), (n_embd, n_pl) */
    const float *pl_post_norm;  /* (n_embd,) gains or NULL (no norm) */
    int mixer;                  /* 0: attention; 1: gated short convolution (LFM2): wq = in_proj (3 n_embd, n_embd),
                                   wo = out_proj, y = C * conv(B * x); the B * x rows of each position go to the
                                   K cache as n_head_kv rows of head_dim_k (= n_embd / n_head_kv), no values */
    long long conv_taps;        /* its causal depthwise convolution: conv_w (n_embd, conv_taps), the last tap
                                   multiplies the new position */
    const float *conv_w;
    const float *k_offset;      /* (n_head_kv, head_dim_k) or NULL: a block-quantized K cache stores keys less
                                   this constant (softmax ignores the shift q . offset; Attention.key_offset) */
    const float *k_scale;       /* (n_head_kv, head_dim_k) powers of two or NULL: a block-quantized K cache stores
                                   (key - k_offset) * k_scale (minirt.kv_balance) */
    const float *q_scale;       /* (n_head, head_dim_k) or NULL: then queries over such a cache are multiplied by
                                   it (1 / the k_scale of the cache layer's KV head of each query head) */
    /* mixer 2: Mamba-2 (Granite 4.0-H, Nemotron-H) with ssm_heads heads of ssm_head_dim values (also n_head,
       head_dim_k = head_dim_v), ssm_groups groups of ssm_state: wq = in_proj (2 inner + 2 G N + heads rows: z,
       xBC, dt; inner = heads * head dim), wo = out_proj (n_embd, inner); conv_w (inner + 2 G N, conv_taps) with
       conv_b or NULL; ssm_dt_b, ssm_a (-exp(A_log)), ssm_d (heads); ssm_norm (inner) or NULL: RMSNorm over each
       group of the gated output. Its state is the sequence's (mr_kvseq.state), no KV rows (n_head_kv 1,
       kv_layer -1). mixer 4 (Falcon-H1): attention as mixer 0 (wq, wk, wv, wo) and a Mamba-2 mixer with the
       same fields but its projections in ssm_in / ssm_out, on the same normed input; the outputs are summed. */
    long long ssm_state, ssm_groups, ssm_heads, ssm_head_dim;
    mr_weight ssm_in, ssm_out;
    const float *conv_b, *ssm_dt_b, *ssm_a, *ssm_d, *ssm_norm;
    /* mixer 3: Qwen3.5's gated delta-net with n_head value heads of head_dim_v (= head_dim_k) and dn_k_heads key
       heads of dn_head_dim: wq = qkv_proj (2 Hk Dk + Hv Dv rows, the convolution's input, conv_w / conv_taps
       without bias), wz = z_proj (Hv Dv), wb = beta_proj (Hv) and wa = alpha_proj (Hv), or wb = the fused
       per-key-head [beta, alpha] rows (2 Hv, dn_fused_ba; wa.data NULL); ssm_dt_b, ssm_a (Hv); ssm_norm (Dv)
       gains of the per-head RMSNorm of the output; dn_grouped: value head j reads key head j / (Hv / Hk), else
       j mod Hk. Its state: convolution inputs (conv_taps - 1, 2 Hk Dk + Hv Dv) and S (Hv, Dk, Dv). */
    long long dn_k_heads, dn_head_dim;
    int dn_grouped, dn_fused_ba;
    mr_weight wz, wb, wa;
    int out_gate;               /* attention: wq gives each head's query then its output gate (2 n_head head_dim_k
                                   rows); the attention output is multiplied by sigmoid(gate) (Qwen3.5) */
    const mr_moe *moe;          /* non-NULL: the feed-forward is this mixture of experts (gate, up, down NULL;
                                   n_ff the widest expert or shared expert) */
    const float *sinks;         /* (n_head) attention-sink logits in each softmax's denominator, or NULL (gpt-oss) */
    int moe_beside;             /* 1: moe runs beside the dense MLP (gate, up, down; n_ff its width) on the residual
                                   x (Gemma 4): ffn = mlp_post(MLP(ffn_norm(x))) + moe_post(MoE(moe_pre(x))), then
                                   post_ffn_norm; the router reads rmsnorm(x) * router_scale (no gains) */
    const float *mlp_post_norm, *moe_pre_norm, *moe_post_norm, *router_scale; /* (n_embd) gains, scale */
} mr_layer;

typedef struct {
    void *k, *v;                /* layer 0's (n_head_kv, n_ctx, row) cache of this sequence, rows in the KV type;
                                   layer l's starts layer_stride bytes after l-1's, its rows of its own head size */
    long long n_ctx, pos;       /* slots; position of the new token */
    long long layer_stride_k, layer_stride_v; /* bytes from one layer's keys (values) to the next */
    float **state;              /* NULL, or 2 per layer: a Mamba-2 layer's convolution inputs (conv_taps - 1,
                                   conv channels) and SSM state (n_head, head_dim_k, ssm_state), updated in place */
} mr_kvseq;

/* 0 when mr_decode_layers can run this layer on `isa`, else an MR_E_* code. */
int mr_layer_check(const mr_layer *L, int isa);

/* Runs n_layer layers over x (n_seq, n_embd), in place: token b belongs to sequence seqs[b], its key
 * and value are written at seqs[b].pos of each layer's cache, stored as type_k / type_v (KV types below).
 * cos_t[i] / sin_t[i]: (n_seq, rope_dim / 2) tables of table pair i (n_tables of them; a layer reads
 * pair rope_table). pl_in: (n_seq, n_layer, n_pl) per-layer inputs when the layers have them (n_pl > 0,
 * the same for every layer), else NULL. Returns < 0 on error, else as mr_matmul (> 0: rows were recomputed,
 * see mr_pool_quiescent). */
int mr_decode_layers(const mr_layer *layers, long long n_layer, float *x, long long n_seq, const mr_kvseq *seqs,
                     int type_k, int type_v, const float *const *cos_t, const float *const *sin_t, int n_tables,
                     const float *pl_in, int threads, int isa);


/* Phase timing of mr_decode_layers, off by default: ns summed over calls and layers for
 * [0] norm + Q/K/V, [1] Q/K norms + RoPE + cache write, [2] attention, [3] output projection +
 * residual, [4] norm + gate/up + activation, [5] down projection + residual; [6] layers run.
 * mr_profile_read copies up to n values (returns how many exist), reset: zero them afterwards. */
void mr_profile_enable(int on);
int mr_profile_read(double *out, int n, int reset);

/* Latest job generation of the pool; 1 when no worker is still inside a job of generation <= gen.
 * mr_pool_steals: items callers took over from descheduled workers since the process started. */
unsigned long long mr_pool_generation(void);
int mr_pool_quiescent(unsigned long long gen);
unsigned long long mr_pool_steals(void);

/* Which code path mr_matmul takes for (qtype, n_tokens, isa): 1 = integer (int16 activations),
 * 2 = float row dots, 3 = float register tile, 4 = float transposed-panel outer products,
 * 6 = integer (int8 activations per 256, MR_XL_Q8); < 0 = error (unsupported qtype or ISA). */
int mr_matmul_path(int qtype, long long n_tokens, int isa);

/* dst[i] = dequantized W row data (n elements, n a multiple of the block size). */
int mr_dequantize(int qtype, const unsigned char *src, long long n, float *dst);

/* out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight  (weight may be NULL: no scaling). */
int mr_rmsnorm(const float *x, const float *weight, float eps, long long rows, long long n,
               float *out, int isa);

/* In-place rotary embedding of x (n_tokens, n_heads, head_dim), the first n_rot dims rotated, from
 * precomputed cos/sin tables (n_tokens, n_rot/2). neox != 0: pairs (i, i + n_rot/2); else (2i, 2i+1). */
int mr_rope_cs(float *x, long long n_tokens, long long n_heads, long long head_dim, long long n_rot,
               const float *cos_t, const float *sin_t, int neox, int isa);

/* In-place softmax of each row of x (rows, n). */
int mr_softmax(float *x, long long rows, long long n, int isa);

/* Sampler statistics of one row of logits x (n): *out_max, *out_lse = log(sum e^x), and the k
 * (0 <= k <= 64) largest elements, value descending (index ascending among equal values), in
 * top_idx / top_val. Returns how many were written (min(k, n)); 0 with NaN in both outputs when
 * x holds a NaN, 0 with the infinite maximum in both when the maximum is not finite; < 0 = error. */
int mr_logit_stats(const float *x, long long n, int k, float *out_max, double *out_lse, long long *top_idx,
                   float *top_val, int isa);

/* KV cache element types: ggml type ids 0 F32, 1 F16, 30 BF16, 8 Q8_0, 2 Q4_0, 3 Q4_1, 6 Q5_0, 7 Q5_1.
 * A cache row holds head_dim values: mr_kv_row_bytes(type, head_dim) bytes (< 0: type not a KV type,
 * or head_dim not a multiple of its block). mr_kv_quantize stores n floats as ggml's reference
 * quantizer does; mr_kv_dequantize reads them back. Attention reads the stored rows directly,
 * converting a tile of at most a few hundred rows at a time. */
int mr_kv_type_ok(int type);
long long mr_kv_row_bytes(int type, long long n);
/* Block-quantized caches store attention rows Hadamard-rotated, as llama.cpp does: the run length
 * rows of head_dim values of this type are rotated in (keys != 0: keys, else values), 0 = none. */
int mr_kv_rotation(int type, long long head_dim, int keys);
/* x (len floats, len a multiple of n, n a power of two up to 4096): each run of n values through that
 * rotation (the orthonormal Walsh-Hadamard matrix in natural order), in place. Returns 0 or < 0. */
int mr_kv_rotate_rows(float *x, long long len, long long n);
int mr_kv_quantize(int type, const float *x, long long n, unsigned char *dst);
int mr_kv_dequantize(int type, const unsigned char *src, long long n, float *dst);

/* Grouped-query attention for one query position over a KV cache.
 * q (n_head, head_dim); k, v: (n_kv, n_ctx, row) rows of head_dim values stored as type_k / type_v;
 * positions [start, n_past) attended, start = max(0, n_past - window) when window > 0;
 * softcap > 0: scores = softcap * tanh(scores / softcap); sinks (n_head) or NULL: per-head logits that join
 * each softmax's denominator only (gpt-oss). out (n_head, head_dim). */
int mr_attention_decode(const float *q, const void *k, const void *v, int type_k, int type_v,
                        long long n_head, long long n_kv, long long n_ctx, long long head_dim,
                        long long n_past, float scale, long long window, float softcap, const float *sinks,
                        float *out, int threads, int isa);

/* out[i] = act(g[i]) * u[i] for i < n; act: 0 = SiLU, 1 = GELU (tanh approximation). out may be g. */
int mr_act_mul(const float *g, const float *u, float *out, long long n, int act, int isa);

/* Causal grouped-query attention of n new queries at positions p0 .. p0+n-1 over a KV cache that
 * already holds their keys and values: q (n, n_head, head_dim); k, v (n_kv, n_ctx, row) stored as
 * type_k / type_v; keys are read in tiles with an online softmax (memory bounded by the tile); query i sees positions max(0, p0+i-window+1) .. p0+i (window 0: all).
 * out (n, n_head * head_dim). */
int mr_attention_prefill(const float *q, long long n, long long n_head, long long head_dim, const void *k,
                         const void *v, int type_k, int type_v, long long n_kv, long long n_ctx, long long p0, float scale,
                         long long window, float softcap, float *out, int threads, int isa);

/* The gated delta rule of n tokens over n_head value heads, each head's state S (n_head, dk, dv)
 * updated in place: per token t, S = decay_t * S; S += k_t (x) beta_t * (v_t - S^T k_t); o_t = S^T q_t.
 * q, k (n, n_head, dk) (q already scaled, key heads already repeated per value head), v and o
 * (n, n_head, dv), decay and beta (n, n_head). dv <= MR_DR_MAX_DV. */
enum { MR_DR_MAX_DV = 1024 };
int mr_delta_rule(float *S, const float *q, const float *k, const float *v, const float *decay, const float *beta,
                  float *o, long long n, long long n_head, long long dk, long long dv, int threads);

/* A causal depthwise convolution: out (n, c) = bias + sum_j rows[t + j] * w_t[j] over taps j, rows
 * (taps - 1 + n, c) being the taps - 1 inputs before the n new ones and those, w_t (taps, c) (tap j multiplies
 * position t - taps + 1 + j), bias (c) or NULL. */
int mr_causal_conv(const float *rows, const float *w_t, const float *bias, float *out, long long n, long long c,
                   long long taps, int threads);

/* Mamba-2's selective scan of n tokens over n_head heads, each head's state S (n_head, head_dim, d_state)
 * updated in place: per token t and head h (group g = h / (n_head / n_group)),
 * S_h = exp(dt_th * a_h) * S_h + (dt_th * x_th) (x) B_tg; y_th = S_h C_tg.
 * x and y (n, n_head, head_dim), dt (n, n_head) (softplus applied), a (n_head), B and C (n, n_group, d_state).
 * n_head a multiple of n_group. */
int mr_ssm_scan(float *S, const float *x, const float *dt, const float *a, const float *B, const float *C,
                float *y, long long n, long long n_head, long long head_dim, long long d_state, long long n_group,
                int threads, int isa);

/* 1 when `isa` has the vectorized attention kernels (else mr_attention_prefill is correct but may be
 * slower than a BLAS-based implementation). */
int mr_attention_fast(int isa);

/* Benchmark helper: runs mr_matmul `reps` times and returns the fastest run in nanoseconds
 * (the minimum filters out interference from other processes on a shared machine); returns only
 * once no worker can still read w or x. */
double mr_bench_matmul(int qtype, const unsigned char *w, long long rows, long long cols, long long row_bytes,
                       const float *x, long long n_tokens, float *y, int threads, int isa, int reps);

/* ---- mixture-of-experts feed-forward (moe.c) ----
 * out (n_tok, n_embd) = sum over j < n_used of w[t, j] * down_e(act(gate_e(x_t)) * up_e(x_t)) (+ each
 * weight's bias), e = ids[t, j] in [0, n_expert). gate, up, down: n_expert weights each, expert e's
 * matrices (its rows of the 3-D GGUF tensor, or their packed copy); gate NULL: down_e(act(up_e(x))).
 * act: 0 SiLU, 1 GELU (tanh), 3 clamped SwiGLU (gpt-oss: alpha, limit), 4 squared ReLU (ungated only). Each chosen expert runs one
 * matmul over all the tokens that chose it; experts no token chose are not read. Returns as mr_matmul. */
int mr_moe_experts(const mr_weight *gate, const mr_weight *up, const mr_weight *down, long long n_expert,
                   const float *x, long long n_tok, long long n_embd, const long long *ids, const float *w,
                   long long n_used, int act, float alpha, float limit, float *out, int threads, int isa);

/* ---- memory-bandwidth probe (bandwidth.c) ----
 * Streaming read of n_bytes at p (n_bytes > 0, a multiple of 8) in 2 MiB slices on `threads` threads
 * (<= 0: the default), `reps` times. Returns the fastest pass in nanoseconds (< 0 = MR_E_* error) and
 * in *sum the wrapping uint64 sum of the buffer's 64-bit words (proof that every byte was read). */
double mr_read_bandwidth(const void *p, long long n_bytes, int threads, int reps, int isa, unsigned long long *sum);
