// Python bindings of the kernels declared in kernels.h.
#include "kernels.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("cached_attention", &zoo::cached_attention,
        "Writes the new keys and values (B, T, Hkv, D) at ends - 1 of cache rows `slots`, then attends each "
        "query of q (B, T, H, D) over its row's cached keys [start, end): cache (S, Hkv, M, D). With cos and "
        "sin (B, T, D), q and the new keys are rotated first (rotary embedding, two-halves layout).",
        py::arg("q"), py::arg("new_keys"), py::arg("new_values"), py::arg("keys"), py::arg("values"), py::arg("slots"),
        py::arg("starts"), py::arg("ends"), py::arg("scale"), py::arg("cos") = py::none(), py::arg("sin") = py::none());
  m.def("cached_attention_qkv", &zoo::cached_attention_qkv,
        "cached_attention of the queries, new keys and new values of one fused projection qkv (B, T, (heads + 2 Hkv) "
        "D), q | k | v, read where they lie (no views to build first); returns (B, T, heads D).",
        py::arg("qkv"), py::arg("heads"), py::arg("keys"), py::arg("values"), py::arg("slots"), py::arg("starts"),
        py::arg("ends"), py::arg("scale"), py::arg("cos") = py::none(), py::arg("sin") = py::none());
  m.def("bf16_decoder_layer", &zoo::bf16_decoder_layer,
        "A Llama-family decoder layer under the bfloat16 policy in one call: rms_norm, bf16_linear (q | k | v), "
        "cached_attention_qkv, bf16_linear (o), add_rms_norm_, bf16_silu_gate, bf16_linear_add_ (down), each as the "
        "layer's modules call it (norm outputs rounded to bfloat16); on_amx: for each GEMM (q | k | v, o, gate | up, "
        "down), whether it multiplies on AMX tiles instead (amx_bf16_linear, amx_bf16_silu_gate, "
        "amx_bf16_linear_add_). x (B, T, hidden) contiguous float32 is added into in place and returned.",
        py::arg("x"), py::arg("input_norm"), py::arg("input_eps"), py::arg("qkv_packed"), py::arg("qkv_bias"),
        py::arg("qkv_features"), py::arg("heads"), py::arg("keys"), py::arg("values"), py::arg("slots"),
        py::arg("starts"), py::arg("ends"), py::arg("scale"), py::arg("cos"), py::arg("sin"), py::arg("o_packed"),
        py::arg("o_bias"), py::arg("post_norm"), py::arg("post_eps"), py::arg("gate_up_packed"),
        py::arg("intermediate"), py::arg("down_packed"), py::arg("down_bias"), py::arg("on_amx"));
  m.def("attention_keys_at_once", &zoo::attention_keys_at_once,
        "Keys cached_attention's tiles of 4-6 query heads score at once on this CPU: 8 or 4 with AVX-512 (the faster "
        "of the two, timed at the first call; `use` sets it instead), 2 on AVX2. The results are the same bits "
        "either way.",
        py::arg("use") = 0);
  m.def("rms_norm", &zoo::rms_norm,
        "weight * x * rsqrt(mean(x^2, -1) + eps), as transformers' RMSNorm computes it; with `rounded` (float32 x), "
        "those outputs rounded to bfloat16",
        py::arg("x"), py::arg("weight"), py::arg("eps"), py::arg("rounded") = false);
  m.def("add_rms_norm_", &zoo::add_rms_norm_, "x += delta in place, then returns rms_norm(x, weight, eps, rounded)",
        py::arg("x"), py::arg("delta"), py::arg("weight"), py::arg("eps"), py::arg("rounded") = false);
  m.def("int8_vnni_available", &zoo::int8_vnni_available,
        "Whether int8_linear was built with AVX512-VNNI (8-bit activations need it; 16-bit ones run on AVX2 too)");
  m.def("int8_linear", &zoo::int8_linear,
        "x (..., K) @ W^T (+ bias) for a group-wise int8 W packed by modelzoo/int8_compute.py, x quantized per row "
        "and chunk to activation_bits (8 or 16) on the fly; (..., out_features) in x's dtype",
        py::arg("x"), py::arg("packed"), py::arg("scales"), py::arg("bias") = py::none(),
        py::arg("out_features"), py::arg("activation_bits"));
  m.def("int8_gemm_paths", &zoo::int8_gemm_paths,
        "int8_linear's code paths here: 'avx2', then 'vnni' (AVX512-VNNI) and 'amx' (AMX-INT8) where built and usable");
  m.def("int8_gemm_path", &zoo::int8_gemm_path,
        "The code path int8_linear takes on this CPU for a call of `rows` rows, one of int8_gemm_paths(): the fastest, "
        "timed once for calls of up to 4 rows and once for longer ones, with 16-bit activations on weights in groups "
        "of `group` inputs (where no call has chosen it yet); 8-bit activations take AMX where it is chosen, else "
        "VNNI. `use` sets it for every call instead. The outputs are the same bits on every path.",
        py::arg("use") = "", py::arg("group") = 32, py::arg("rows") = 64);
  m.def("bf16_dot_available", &zoo::bf16_dot_available, "Whether bf16_linear was built (AVX512-BF16)");
  m.def("bf16_linear", &zoo::bf16_linear,
        "x (..., K) rounded to bfloat16 @ W^T (+ bias) for a bfloat16 W packed by modelzoo/precision.py, summed and "
        "returned in float32 (..., out_features)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("out_features"));
  m.def("bf16_silu_gate", &zoo::bf16_silu_gate,
        "silu(gate) * up of x (..., K) rounded to bfloat16 @ [gate | up]^T, for the gate | up weight packed by "
        "modelzoo/precision.py in tiles of 2 gate + 2 up blocks; float32 (..., out_features), silu_mul's bits; with "
        "`rounded`, those outputs rounded to bfloat16 (what the next bfloat16 GEMM multiplies them as)",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("rounded") = false);
  m.def("bf16_linear_rows", &zoo::bf16_linear_rows,
        "bf16_linear with the weight read where it lies: x (..., K) rounded to bfloat16 @ [W_0 | W_1 | ...]^T (+ bias) "
        "for parts (N_i, K) bfloat16 with unit column stride (a memory-mapped checkpoint's rows; every N_i but the last "
        "a multiple of 16), (..., sum N_i) float32, the bits of bf16_linear over the packed concatenation",
        py::arg("x"), py::arg("parts"), py::arg("bias") = py::none());
  m.def("bf16_silu_gate_rows", &zoo::bf16_silu_gate_rows,
        "bf16_silu_gate with gate and up (I, K) bfloat16 read where they lie (I a multiple of 32): silu(gate) * up "
        "(..., I) float32 (bfloat16 with `rounded`), the bits of bf16_silu_gate",
        py::arg("x"), py::arg("gate"), py::arg("up"), py::arg("rounded") = false);
  m.def("bf16_linear_add_", &zoo::bf16_linear_add_,
        "residual += bf16_linear(x, packed, bias, out_features) in place (each output added as residual + linear(x) "
        "adds it): a residual sum without a separate pass; residual (..., out_features) float32, returned",
        py::arg("residual"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("out_features"));
  m.def("bf16_linear_rows_add_", &zoo::bf16_linear_rows_add_,
        "residual += bf16_linear_rows(x, parts, bias) in place (bf16_linear_add_ with the weight read where it lies)",
        py::arg("residual"), py::arg("x"), py::arg("parts"), py::arg("bias") = py::none());
  m.def("bf16_greedy_rows", &zoo::bf16_greedy_rows,
        "bf16_greedy with the weight read where it lies (parts as bf16_linear_rows): "
        "bf16_linear_rows(x, parts, bias).max(-1).indices without writing the outputs; int64 (...)",
        py::arg("x"), py::arg("parts"), py::arg("bias") = py::none());
  m.def("pack_bf16_rows", &zoo::pack_bf16_rows,
        "parts (N_i, K) bfloat16 with unit column stride (with silu_gate: gate and up (I, K), in bf16_silu_gate's tiles) "
        "packed into out (ceil(N/16), ceil(K/2), 16, 2) bfloat16, bf16_linear's layout, every block in parallel",
        py::arg("parts"), py::arg("silu_gate"), py::arg("out"));
  m.def("bf16_gemm_broadcast", &zoo::bf16_gemm_broadcast,
        "How bf16_linear and bf16_silu_gate broadcast each input pair on this CPU: 'embedded' (read by every "
        "product) or 'register' (broadcast once), the faster of the two timed at the first call; `use` sets it "
        "instead. The outputs are the same bits either way.",
        py::arg("use") = "");
  m.def("bf16_greedy", &zoo::bf16_greedy,
        "bf16_linear(x, packed, bias, out_features).max(-1).indices without writing the outputs: each row's first "
        "largest output (the first NaN where there is one); int64 (...)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("out_features"));
  m.def("amx_bf16_available", &zoo::amx_bf16_available,
        "Whether amx_bf16_linear was built (AMX-BF16) and Linux grants this process the AMX tiles");
  m.def("amx_bf16_linear", &zoo::amx_bf16_linear,
        "bf16_linear on AMX tiles: x (..., K) rounded to bfloat16 @ W^T (+ bias) for bf16_linear's packed W, summed "
        "and returned in float32 (..., out_features)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("out_features"));
  m.def("amx_bf16_greedy", &zoo::amx_bf16_greedy,
        "amx_bf16_linear(x, packed, bias, out_features).max(-1).indices without writing the outputs: each row's "
        "first largest output (the first NaN where there is one); int64 (...)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("out_features"));
  m.def("amx_bf16_linear_add_", &zoo::amx_bf16_linear_add_,
        "residual += amx_bf16_linear(x, packed, bias, out_features) in place, each output added as it is written "
        "(as residual + amx_bf16_linear adds it); residual (..., out_features) float32, returned",
        py::arg("residual"), py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("out_features"));
  m.def("amx_bf16_silu_gate", &zoo::amx_bf16_silu_gate,
        "bf16_silu_gate on AMX tiles: silu(gate) * up for the gate | up weight packed as bf16_silu_gate's; float32 "
        "(..., out_features), silu_mul's bits; with `rounded`, those outputs rounded to bfloat16",
        py::arg("x"), py::arg("packed"), py::arg("out_features"), py::arg("rounded") = false);
  m.def("half_linear", &zoo::half_linear,
        "x (..., K) float32 @ W^T (+ bias) for a bfloat16, float16 or float32 W packed (N/16, K, 16) by "
        "modelzoo/precision.py, widened to float32 as it is read: one fused multiply-add per input in ascending order, "
        "(..., out_features) float32",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("out_features"));
  m.def("half_greedy", &zoo::half_greedy,
        "half_linear(x, packed, bias, out_features).max(-1).indices without writing the outputs: each row's first "
        "largest output (the first NaN where there is one); int64 (...)",
        py::arg("x"), py::arg("packed"), py::arg("bias") = py::none(), py::arg("out_features"));
  m.def("half_linear_rows", &zoo::half_linear_rows,
        "half_linear with the weight read where it lies: x (..., K) float32 @ [W_0 | W_1 | ...]^T (+ bias) for parts "
        "(N_i, K) bfloat16 or float16 with unit column stride (a memory-mapped checkpoint's rows; every N_i but the "
        "last a multiple of 16), (..., sum N_i) float32, the bits of half_linear over the packed concatenation",
        py::arg("x"), py::arg("parts"), py::arg("bias") = py::none());
  m.def("half_greedy_rows", &zoo::half_greedy_rows,
        "half_greedy with the weight read where it lies (parts as half_linear_rows): "
        "half_linear_rows(x, parts, bias).max(-1).indices without writing the outputs; int64 (...)",
        py::arg("x"), py::arg("parts"), py::arg("bias") = py::none());
  m.def("pack_half_weight", &zoo::pack_half_weight,
        "W (N, K) bfloat16, float16 or float32 -> (ceil(N/16), K, 16) in its dtype: for each input, 16 output rows' "
        "values side by side, zero rows padding N (the layout half_linear reads), written into `out` (contiguous, "
        "of that shape and dtype) where given, else into new memory; blocks packed in parallel",
        py::arg("weight"), py::arg("out") = py::none());
  m.def("half_gemm_path", &zoo::half_gemm_path,
        "The code path of half_linear on this CPU: 'avx2' or 'avx512' (where built), the faster of the two timed at "
        "the first call; `use` sets it instead. The outputs are the same bits either way.",
        py::arg("use") = "");
  m.def("lora_update_", &zoo::lora_update_,
        "out (M, N) += each row's LoRA update B_g A_g x (M, K) for its adapter g = row_adapter (M,) (-1: none), from "
        "every adapter's stacked a (C, K padded to 16) and b_t (C, N) float32 and segments (S, 5) int64 (adapter, "
        "columns, outputs); the layout is modelzoo/lora.py's",
        py::arg("out"), py::arg("x"), py::arg("row_adapter"), py::arg("a"), py::arg("b_t"), py::arg("segments"));
  m.def("sort_rows", &zoo::sort_rows,
        "torch.sort(scores, -1, stable=True) of float32 rows (B, V): (values, int64 indices), by a radix sort",
        py::arg("scores"));
  m.def("draw_rows", &zoo::draw_rows,
        "sampling.draw(probs, u): each row's first index whose float64 running sum of probs (B, V) float32 exceeds "
        "u (B,) float64 times the row's total, capped at its last positive weight; 0 where the total is not positive",
        py::arg("probs"), py::arg("u"));
  m.def("silu_mul", &zoo::silu_mul, "silu(gate) * up for gate_up = gate | up along the last dimension");
}
