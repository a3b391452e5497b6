"""Every causal-LM family this `transformers` ships, as a tiny random model: does
`apply(ALL_FUSIONS)` build, match eager and take launches away? A model we have not seen is
most likely one of these, and each spells its blocks its own way.

Each family runs in its own process (a hang or a crash is that family's result), with its
attention as SDPA and written out ("eager"). A family whose tiny config cannot be built
generically is recorded as "unbuilt", not failed. On the CPU the kernels run in Triton's
interpreter (fp32); on a GPU in bf16, judged as tune judges (advisor/verify.py).

    python benchmarks/family_sweep.py [--only llama,gpt2] [--timeout 240] [--jobs 2]
    -> $OUT/family-sweep.json (one row per family and attention form)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch

# the sizes a tiny model takes, by each name configs spell them with
_TINY = {
    ("hidden_size", "n_embd", "d_model", "dim", "embed_dim"): 64,
    ("num_hidden_layers", "n_layer", "num_layers", "n_layers"): 2,
    ("num_attention_heads", "n_head", "n_heads", "num_heads"): 4,
    ("num_key_value_heads", "n_kv_heads", "num_kv_heads"): 2,
    ("head_dim", "kv_channels"): 16,
    ("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size"): 96,
    ("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size"): 32,
    ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"): 4,
    ("num_experts_per_tok", "top_k", "moe_topk"): 2,
    ("vocab_size",): 128,
    ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"): 256,
    # multi-head latent attention (DeepSeek-V2/V3 and their kin): per-head dims and ranks
    ("qk_rope_head_dim",): 8, ("qk_nope_head_dim",): 8, ("v_head_dim",): 12,  # Dv != Dk (16)
    ("kv_lora_rank", "q_lora_rank"): 32,
    ("rotary_dim",): 8,  # GPT-J, CodeGen: within the head dim
    ("n_group", "num_expert_group", "topk_group"): 1,  # grouped routing over 4 experts
}
# unset (None: derived from the others) in some configs, set to the tiny value as well
_DERIVED = {"head_dim", "n_inner", "num_key_value_heads", "num_experts_per_tok"}
_VOCAB = 128


# --dense-moe: every token routed to every expert. A bf16 rounding anywhere (a fused kernel's
# or eager's own) can flip a top-k routing near a tie, which moves a tiny model's output by
# far more than rounding: with all experts taken, what is left to judge is the kernels.
_DENSE_MOE = {("num_experts_per_tok", "top_k", "moe_topk"): 4}


def _tiny_config(model_type: str, dense_moe: bool = False):
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    text = getattr(config, "text_config", None) or config
    if getattr(text, "per_layer_config", None):  # Gemma 4: per-layer head
        text.per_layer_config = {}  # dims; a tiny model takes one size for every layer
    for names, value in {**_TINY, **(_DENSE_MOE if dense_moe else {})}.items():
        for name in names:
            held = getattr(text, name, None) if name in text.to_dict() else False
            if (isinstance(held, int) and not isinstance(held, bool)) or (held is None and name in _DERIVED):
                setattr(text, name, value)
    if isinstance(getattr(text, "qk_rope_head_dim", None), int) and "head_dim" in text.to_dict():
        text.head_dim = text.qk_rope_head_dim  # MLA configs: the RoPE tables' width, and
        if "num_key_value_heads" in text.to_dict():  # k, v made per q head (no GQA repeat)
            text.num_key_value_heads = text.num_attention_heads
    for field in ("layer_types", "block_types"):
        kinds = getattr(text, field, None)
        if isinstance(kinds, list) and kinds:  # per-layer kinds (linear, full, sliding...): each
            kinds = list(dict.fromkeys(kinds))  # kind once at least (Qwen3.5's first layers are
            n = max(text.num_hidden_layers, len(kinds))  # all linear attention)
            try:
                setattr(text, field, (kinds * n)[:n])
                text.num_hidden_layers = n
            except AttributeError:  # a property derived from other fields (Mamba's)
                pass
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(text, name, None), int) and getattr(text, name) >= _VOCAB:
            setattr(text, name, 0)
    return config


def _randomise(model: torch.nn.Module) -> None:
    """Norm weights away from 1, small biases: a dropped term shows."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.uniform_(0.5, 1.5) if "norm" in n or "ln" in n else p.normal_(0, 0.02)


def check_one(model_type: str, attention: str, dtype: torch.dtype | None = None,
              bisect: bool = False, alone: tuple[str, ...] = (), ops: bool = False,
              dense_moe: bool = False) -> dict:
    """apply(ALL_FUSIONS) against eager at 5 and 11 tokens, batch 2 (no cache); dtype: bf16
    on a GPU, fp32 on the CPU unless given. bisect: each applied family (and each of `alone`)
    alone too; ops: the attention ops the trace records and the matches found on its graph
    (which SDPA form this device picks); dense_moe: every expert taken per token.
    A wrong row also judges torch.compile(backend="aot_eager") of the model ("compiled"): when
    that is as wrong, the traced program itself differs from eager (dynamo's view of the
    model's Python), not a kernel or a rewrite of ours."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from advisor.runtime.apply import apply
    from advisor.runtime.plan import ALL_FUSIONS, Plan
    from advisor.verify import fp32_copy, needs_truth

    row: dict = {"family": model_type, "attention": attention}
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = dtype or (torch.bfloat16 if dev.type == "cuda" else torch.float32)
    try:
        config = _tiny_config(model_type, dense_moe)
        torch.manual_seed(0)
        cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
        text = getattr(config, "text_config", None)
        if text is not None and isinstance(text, cls.config_class):  # Llama 4, Emu3: the
            config = text  # causal LM takes the text part of a composite config
        config._attn_implementation = attention
        model = cls(config).eval()
        _randomise(model)
        model = model.to(dev, dtype)
        inputs = {t: torch.randint(2, _VOCAB, (2, t), device=dev,
                                   generator=torch.Generator(dev).manual_seed(t)) for t in (5, 11)}
        with torch.no_grad():
            model(input_ids=inputs[5], use_cache=False)
    except Exception as exc:  # noqa: BLE001 - a config this script cannot make tiny
        return {**row, "status": "unbuilt", "error": f"{type(exc).__name__}: {exc}"[:300]}
    if ops:
        row["graph"] = _attention_graph(model, inputs[5])
    started = time.perf_counter()
    try:
        exact = fp32_copy(model) if needs_truth(dtype) else None
        fast = apply(model, ALL_FUSIONS)
        verdicts = _verdicts(fast, model, exact, inputs, dtype)
        rows = fast.summary()
    except Exception as exc:  # noqa: BLE001 - a crash in apply is this family's result
        return {**row, "status": "crashed", "error": f"{type(exc).__name__}: {exc}"[:500],
                "where": traceback.format_exc().strip().splitlines()[-6:]}
    total = next((r for r in rows if r["family"] == "(all)"), {})
    applied = {r["family"]: r["applied"] for r in rows if r.get("applied")}
    ok = all(v.ok for v in verdicts)
    row.update(status="ok" if ok else "wrong", verdicts=[v.detail for v in verdicts], applied=applied,
               unfused={r["family"]: r["unfused"] for r in rows if r.get("unfused")},
               notes={r["family"]: r["notes"] for r in rows if r.get("notes")},
               launches_before=total.get("launches_before"), launches_after=total.get("launches_after"),
               compiles=total.get("compiles"), seconds=round(time.perf_counter() - started, 1))
    if not ok:
        compiled = torch.compile(model, backend="aot_eager", dynamic=False)
        row["compiled"] = [v.detail for v in _verdicts(compiled, model, exact, inputs, dtype)]
    if bisect:  # which family alone is wrong (or what it takes alone): the place to look
        row["alone"] = {}
        for family in dict.fromkeys((*applied, *alone)):
            fast = apply(model, Plan(fusions=(family,)))
            alone = _verdicts(fast, model, exact, inputs, dtype)
            took = next(r for r in fast.summary() if r["family"] == family)
            row["alone"][family] = {"applied": took["applied"], "unfused": took["unfused"],
                                    "ok": all(v.ok for v in alone), "verdicts": [v.detail for v in alone]}
    return row


def _attention_graph(model: torch.nn.Module, ids: torch.Tensor) -> list[dict]:
    """Per captured graph: its attention and softmax nodes (op, argument shapes) and the
    families `find_all` matches there, with counts."""
    from collections import Counter

    from advisor.graph.capture import capture, fake
    from advisor.graph.patterns import find_all

    parts = []
    for part in capture(model, {"input_ids": ids, "use_cache": False}).parts:
        nodes = [{"op": str(n.target), "args": [tuple(t.shape) if (t := fake(a)) is not None else repr(a)[:40]
                                                for a in n.args[:4]], "kwargs": sorted(n.kwargs)}
                 for n in part.gm.graph.nodes
                 if n.op == "call_function" and any(w in str(n.target) for w in ("attention", "softmax"))]
        found = Counter(m.family for m in find_all(part.gm, part.params))
        parts.append({"nodes": nodes, "found": dict(found)})
    return parts


def _verdicts(fast, model, exact, inputs: dict, dtype: torch.dtype) -> list:
    """verify.judge of `fast` against eager `model` (and the fp32 `exact`) at each input."""
    from advisor.verify import judge

    out = []
    for ids in inputs.values():
        with torch.no_grad():
            got, ref = (m(input_ids=ids, use_cache=False).logits for m in (fast, model))
            truth = exact(input_ids=ids, use_cache=False).logits if exact is not None else None
        out.append(judge(got, ref, dtype, truth))
    return out


def _families() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _in_child(model_type: str, attention: str, timeout: float, dtype: str, bisect: bool,
              alone: str, ops: bool, dense_moe: bool) -> dict:
    cmd = [sys.executable, __file__, "--child", model_type, attention, "--dtype", dtype,
           *(["--bisect", "--alone", alone] if bisect else []), *(["--ops"] if ops else []),
           *(["--dense-moe"] if dense_moe else [])]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"family": model_type, "attention": attention, "status": "timeout", "seconds": timeout}
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"family": model_type, "attention": attention, "status": "died",
                "returncode": done.returncode,  # -9: killed (out of memory: a config left large)
                "error": done.stderr.strip().splitlines()[-3:]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--only", default="", help="comma-separated model types")
    parser.add_argument("--timeout", type=float, default=240.0)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--dtype", default="", help="bfloat16, float16 or float32 (default: bf16 "
                        "on a GPU, fp32 on the CPU)")
    parser.add_argument("--bisect", action="store_true", help="each applied fusion alone too")
    parser.add_argument("--alone", default="", help="with --bisect: families to try alone as well")
    parser.add_argument("--ops", action="store_true",
                        help="record the traced attention ops and the matches found")
    parser.add_argument("--dense-moe", action="store_true",
                        help="route every token to every expert (no top-k flips on rounding)")
    parser.add_argument("--child", nargs=2, metavar=("MODEL_TYPE", "ATTENTION"))
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # our kernels on the CPU
    if args.child:
        dtype = getattr(torch, args.dtype) if args.dtype else None
        print(json.dumps(check_one(*args.child, dtype, args.bisect,
                                   tuple(f for f in args.alone.split(",") if f), args.ops,
                                   args.dense_moe), default=str), flush=True)
        return
    from benchmarks.common import header, write

    todo = [(f, a) for f in (args.only.split(",") if args.only else _families()) for a in ("sdpa", "eager")]
    with ThreadPoolExecutor(args.jobs) as pool:
        results = []
        for res in pool.map(lambda fa: _in_child(*fa, args.timeout, args.dtype, args.bisect, args.alone,
                                                         args.ops, args.dense_moe), todo):
            results.append(res)
            print(json.dumps({k: res.get(k) for k in ("family", "attention", "status", "applied",
                                                      "launches_before", "launches_after", "error", "compiled",
                                                      "alone")},
                             default=str), flush=True)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    payload = header(dev, dtype=args.dtype or ("bfloat16" if dev.type == "cuda" else "float32"),
                     shapes="batch 2, tokens 5/11, tiny configs (hidden 64, 2 layers)"
                     + (", every expert per token" if args.dense_moe else ""))
    import transformers

    payload["environment"]["transformers"] = transformers.__version__
    payload["counts"] = {s: sum(r["status"] == s for r in results)
                         for s in sorted({r["status"] for r in results})}
    payload["results"] = results
    print(write("family-sweep.json", payload), payload["counts"])


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
