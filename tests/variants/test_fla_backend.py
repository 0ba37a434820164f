"""The optional flash-linear-attention backend (``zoo.ops.backends.fla``) of the delta rule and gated linear attention.

On the CPU (these run everywhere): fla is never imported, nor touched when a module of that name is present; the
dispatch gives None for CPU tensors, fp32/fp64, head dims fla does not take and ``ATTENTION_ZOO_FLA=0``; the
adapters hand fla its layout and conventions ((B, n, H, d), β in q's dtype, per-token log α in fp32, the fp32
initial state, ``output_final_state``, no in-kernel L2 norm), checked against a stand-in fla with fla 0.6.0's
signatures that runs the zoo's recurrences.

On CUDA with fla installed (skipped elsewhere; ``scripts/gpu_check.sh`` runs them, step ``fla-tests``): fla's
kernels against the zoo's chunked kernels on the same device, forward and backward, bf16, n = 100 (no chunk
multiple), an initial state, d_k != d_v, for the delta rule, the gated delta rule and gated linear attention with a
per-channel and a per-head decay; fp32 stays on the zoo's kernels (identical results); and the variants in a small
bf16 Llama, forward + backward and prefill-then-decode, run on fla and agree with the zoo's kernels.
Tolerances (relative RMS error, as fla's own tests measure it): 0.03 for outputs and final states, 0.08 for the
gradients of q, k, v and the initial state, 0.15 for those of β, log α and of the model's weights (sums over every
token) -- fla keeps its chunk intermediates (W, U, per-chunk states) in bf16 where the zoo keeps fp32; fla's own
tests hold fp16 (3 more mantissa bits than bf16) to 0.005-0.008, and β's and log α's gradients to 0.02. A
convention mismatch (state transposed, decay cumulated twice, scale, β) gives errors of order 1. A failure prints
every error, so one GPU run calibrates them.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types

import pytest
import torch
import transformers

import zoo
from zoo import testing
from zoo.ops.backends import fla as fla_backend
from zoo.ops.delta_rule import chunk as delta_rule_module
from zoo.ops.delta_rule import delta_rule
from zoo.ops.delta_rule.naive import delta_rule_recurrence
from zoo.ops.gated_linear import chunk as gated_linear_module
from zoo.ops.gated_linear import gated_linear_attention
from zoo.ops.gated_linear.naive import gated_linear_recurrence

HAS_FLA = torch.cuda.is_available() and importlib.util.find_spec("fla") is not None  # find_spec imports nothing
cuda_fla = pytest.mark.skipif(not HAS_FLA, reason="needs CUDA and flash-linear-attention (attention-zoo[fla])")
CASES = ["delta_rule", "gated_delta_rule", "gla", "simple_gla"]  # the names fla_backend.KERNELS dispatches on
OUT_TOL, GRAD_TOL, GATE_GRAD_TOL = 0.03, 0.08, 0.15


def inputs(case: str, n: int = 100, batch: int = 2, heads: int = 3, d_k: int = 32, d_v: int = 48,
           dtype=torch.bfloat16, device="cpu", seed: int = 0) -> dict:
    """The kernel's arguments as the variants give them: q, k (k L2-normalized; q too for the delta rule), v in
    ``dtype``; β, log α and the initial state in fp32; every tensor a leaf that requires grad."""
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(batch, heads, n, d_k, generator=gen) for _ in range(2))
    v = torch.randn(batch, heads, n, d_v, generator=gen)
    state = torch.randn(batch, heads, d_k, d_v, generator=gen) * 0.5
    args = {"k": torch.nn.functional.normalize(k, dim=-1), "v": v}
    if case in ("delta_rule", "gated_delta_rule"):
        args["q"] = torch.nn.functional.normalize(q, dim=-1)
        args["beta"] = torch.rand(batch, heads, n, generator=gen)
        args["log_decay"] = (torch.nn.functional.logsigmoid(torch.randn(batch, heads, n, generator=gen) + 3)
                             if case == "gated_delta_rule" else None)
        args["scale"] = d_k**-0.5
    else:
        args["q"] = q
        shape = (batch, heads, n, d_k) if case == "gla" else (batch, heads, n)
        args["log_decay"] = torch.nn.functional.logsigmoid(torch.randn(*shape, generator=gen)) / 16
        args["scale"] = d_k**-0.5
    args["initial_state"] = state
    for name in ("q", "k", "v"):
        args[name] = args[name].to(dtype)
    return {name: x.to(device).requires_grad_() if isinstance(x, torch.Tensor) else x for name, x in args.items()}


def run(case: str, args: dict):
    """(out, final state) of the zoo's entry point for ``case``."""
    if case in ("delta_rule", "gated_delta_rule"):
        return delta_rule(args["q"], args["k"], args["v"], args["beta"], args["log_decay"], args["scale"],
                          initial_state=args["initial_state"])
    return gated_linear_attention(args["q"], args["k"], args["v"], args["log_decay"], args["scale"],
                                  initial_state=args["initial_state"])


def forward_backward(case: str, args: dict, seed: int = 1) -> dict:
    """Outputs, final state and every leaf's gradient of ``run`` under fixed random output gradients."""
    for x in args.values():
        if isinstance(x, torch.Tensor):
            x.grad = None
    out, final = run(case, args)
    gen = torch.Generator().manual_seed(seed)
    d_out = torch.randn(out.shape, generator=gen).to(out.device)
    d_final = torch.randn(final.shape, generator=gen).to(final.device)
    ((out.float() * d_out).sum() + (final.float() * d_final).sum()).backward()
    found = {"out": out.detach().float(), "final": final.detach().float()}
    found.update({f"d{name}": x.grad.float() for name, x in args.items() if isinstance(x, torch.Tensor)})
    return found


def ratio(want: torch.Tensor, got: torch.Tensor) -> float:
    """RMS of the difference over the RMS of ``want``."""
    return ((want - got).square().mean().sqrt() / want.square().mean().sqrt().clamp_min(1e-12)).item()


def assert_close_ratio(want: dict, got: dict, out_tol: float, grad_tol: float, gate_tol: float | None = None) -> None:
    """Gradients are the entries named d...; those of β and log α (dbeta, dlog_decay) are held to ``gate_tol``."""
    errors = {name: ratio(want[name], got[name]) for name in want}

    def tolerance(name: str) -> float:
        if name in ("dbeta", "dlog_decay") and gate_tol is not None:
            return gate_tol
        return grad_tol if name.startswith("d") else out_tol

    bad = {name: e for name, e in errors.items() if e > tolerance(name)}
    assert not bad, f"relative RMS errors over tolerance: {bad}; all: {errors}"


# ---------------------------------------------------------------------------------------------------------------
# CPU: fla is never imported nor touched


class Tripwire(types.ModuleType):
    """A stand-in ``fla`` module that records every non-dunder attribute read (how a kernel would be fetched)."""

    def __init__(self, name: str, touched: list) -> None:
        super().__init__(name)
        object.__setattr__(self, "_touched", touched)

    def __getattribute__(self, attr: str):
        if not attr.startswith("__") and attr != "_touched":
            object.__getattribute__(self, "_touched").append(f"{object.__getattribute__(self, '__name__')}.{attr}")
            raise AttributeError(attr)
        return super().__getattribute__(attr)


@pytest.fixture
def tripwire(monkeypatch) -> list:
    """fla and the modules the backend would import are Tripwires in sys.modules; the backend's caches cleared."""
    touched: list = []
    for name in ["fla", "fla.ops", *(module for module, _ in fla_backend.KERNELS.values())]:
        monkeypatch.setitem(sys.modules, name, Tripwire(name, touched))
    monkeypatch.setattr(fla_backend, "_loaded", {})
    fla_backend.installed.cache_clear()
    yield touched
    fla_backend.installed.cache_clear()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("case", CASES)
def test_cpu_tensors_never_reach_fla(tripwire, case, dtype):
    args = inputs(case, n=20, dtype=dtype)
    assert fla_backend.fla_kernel(case, args["q"], args["k"], args["v"]) is None
    out, final = run(case, args)
    (out.float().sum() + final.sum()).backward()
    assert tripwire == []


@pytest.mark.parametrize("name, params", [("deltanet", {}), ("gated_deltanet", {}), ("gla", {}),
                                          ("gla", {"decay": "scalar"})])
def test_a_cpu_model_forward_never_touches_fla(tripwire, name, params):
    model = testing.causal_lm(name, **params).to(torch.bfloat16)
    ids = torch.randint(3, 64, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)
        cache = zoo.make_cache(model)
        model(ids[:, :15], cache=cache, use_cache=True)
        model(ids[:, 15:16], cache=cache, use_cache=True)
    assert tripwire == []


def test_importing_zoo_and_a_cpu_forward_leave_fla_unimported(tmp_path):
    """A fresh interpreter with an ``fla`` package on its path that fails when imported: ``import zoo`` and CPU
    forwards of every recurrent variant (bf16, where fla would be asked on CUDA) never import it."""
    fake = tmp_path / "fla"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('fla imported on a CPU run')\n")
    code = (
        "import sys, torch, zoo\n"
        "from zoo import testing\n"
        "for name, params in [('deltanet', {}), ('gated_deltanet', {}), ('gla', {}), ('gla', {'decay': 'scalar'})]:\n"
        "    model = testing.causal_lm(name, **params).to(torch.bfloat16)\n"
        "    with torch.no_grad():\n"
        "        model(torch.randint(3, 64, (1, 12)))\n"
        "assert not any(m == 'fla' or m.startswith('fla.') for m in sys.modules), 'fla in sys.modules'\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
           "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    env.pop(fla_backend.ENV, None)
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                            cwd=tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


class FakeTensor(types.SimpleNamespace):
    """What :func:`fla_backend.applies` reads of a tensor, for a CUDA tensor on a machine without one."""


def fake(dtype=torch.bfloat16, dim=64, cuda=True):
    return FakeTensor(is_cuda=cuda, dtype=dtype, shape=(1, 2, 10, dim))


def test_the_dispatch_takes_half_precision_cuda_calls_only(monkeypatch):
    monkeypatch.delenv(fla_backend.ENV, raising=False)
    assert fla_backend.applies(fake(), fake(), fake())
    assert fla_backend.applies(fake(torch.float16), fake(torch.float16), fake(torch.float16, dim=128))
    assert not fla_backend.applies(fake(cuda=False), fake(cuda=False), fake(cuda=False))
    for dtype in (torch.float32, torch.float64):  # fla: no fp32 delta rule, TF32 products elsewhere
        assert not fla_backend.applies(fake(dtype), fake(dtype), fake(dtype))
    assert not fla_backend.applies(fake(), fake(), fake(torch.float16))  # mixed dtypes
    assert not fla_backend.applies(fake(dim=512), fake(dim=512), fake())  # head dims fla does not take
    assert not fla_backend.applies(fake(dim=33), fake(dim=33), fake())


@pytest.mark.parametrize("value, on", [("0", False), (" 0 ", False), ("1", True), ("", True)])
def test_the_environment_switch(monkeypatch, value, on):
    monkeypatch.setenv(fla_backend.ENV, value)
    assert fla_backend.enabled() is on
    assert fla_backend.applies(fake(), fake(), fake()) is on


def test_a_missing_fla_is_none_and_remembered(monkeypatch, caplog):
    monkeypatch.setattr(fla_backend, "_loaded", {})
    monkeypatch.setitem(sys.modules, "fla.ops.delta_rule", None)  # import_module raises ModuleNotFoundError
    assert fla_backend.load("delta_rule") is None
    assert fla_backend._loaded == {"delta_rule": None} and "does not import" not in caplog.text


def test_an_fla_that_fails_to_import_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(fla_backend, "_loaded", {})
    monkeypatch.setitem(sys.modules, "fla.ops.gla", Tripwire("fla.ops.gla", []))  # chunk_gla: AttributeError
    assert fla_backend.load("gla") is None and fla_backend.load("gla") is None
    assert caplog.text.count("fla.ops.gla.chunk_gla does not import (AttributeError") == 1


# ---------------------------------------------------------------------------------------------------------------
# CPU: the adapters speak fla's conventions (a stand-in fla with fla 0.6.0's signatures runs the zoo's recurrences)


def check_layout(q, k, v, initial_state, output_final_state, per_token=(), **kwargs):
    """What fla 0.6.0's chunk functions take: (B, T, H, d) q/k/v of one half dtype, gates (B, T, H[, K]), the initial
    state (B, H, K, V) fp32, ``output_final_state``; no variable lengths, no chunk size, no head_first."""
    batch, n, heads, d_k = q.shape
    assert k.shape == q.shape and v.shape[:3] == (batch, n, heads) and q.dtype == k.dtype == v.dtype
    assert q.dtype in (torch.bfloat16, torch.float16)
    assert initial_state is None or (initial_state.dtype == torch.float32
                                     and initial_state.shape == (batch, heads, d_k, v.shape[-1]))
    assert output_final_state is True
    assert all(x is None for x in kwargs.values()), kwargs
    for gate in per_token:
        assert gate.shape[:3] == (batch, n, heads)


def zoo_layout(*xs):
    return [None if x is None else x.transpose(1, 2) for x in xs]


def fake_chunk_delta_rule(q, k, v, beta, scale=None, initial_state=None, output_final_state=False,
                          use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None):
    check_layout(q, k, v, initial_state, output_final_state, (beta,), cu_seqlens=cu_seqlens,
                 cu_seqlens_cpu=cu_seqlens_cpu)
    assert beta.dim() == 3 and beta.dtype == q.dtype and use_qk_l2norm_in_kernel is False and scale is not None
    out, final = delta_rule_recurrence(*zoo_layout(q, k, v, beta), None, scale, initial_state)
    return out.transpose(1, 2), final


def fake_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                use_qk_l2norm_in_kernel=False, use_beta_sigmoid_in_kernel=False,
                                allow_neg_eigval=False, state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None,
                                chunk_indices=None, cp_context=None):
    check_layout(q, k, v, initial_state, output_final_state, (beta, g), cu_seqlens=cu_seqlens,
                 cu_seqlens_cpu=cu_seqlens_cpu, chunk_indices=chunk_indices, cp_context=cp_context)
    assert g.dim() == 3 and g.dtype == torch.float32 and beta.dim() == 3 and beta.dtype == q.dtype
    assert not (use_qk_l2norm_in_kernel or use_beta_sigmoid_in_kernel or allow_neg_eigval or state_v_first)
    out, final = delta_rule_recurrence(*zoo_layout(q, k, v, beta, g), scale, initial_state)
    return out.transpose(1, 2), final


def fake_chunk_gla(q, k, v, g, scale=None, initial_state=None, output_final_state=False, state_v_first=False,
                   cu_seqlens=None, cu_seqlens_cpu=None):
    check_layout(q, k, v, initial_state, output_final_state, (g,), cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    assert g.shape == q.shape and g.dtype == torch.float32 and not state_v_first and scale is not None
    out, final = gated_linear_recurrence(*zoo_layout(q, k, v, g), scale, initial_state)
    return out.transpose(1, 2), final


def fake_chunk_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None, output_final_state=False,
                          state_v_first=False, cu_seqlens=None, cu_seqlens_cpu=None):
    check_layout(q, k, v, initial_state, output_final_state, (g,), g_gamma=g_gamma, cu_seqlens=cu_seqlens,
                 cu_seqlens_cpu=cu_seqlens_cpu)
    assert g.dim() == 3 and g.dtype == torch.float32 and not state_v_first and scale is not None
    out, final = gated_linear_recurrence(*zoo_layout(q, k, v, g), scale, initial_state)
    return out.transpose(1, 2), final


def counted(fn, calls: list):
    """``fn`` appending to ``calls`` at each call."""

    def wrapper(*args, **kwargs):
        calls.append(fn.__name__)
        return fn(*args, **kwargs)

    return wrapper


FAKES = {"delta_rule": fake_chunk_delta_rule, "gated_delta_rule": fake_chunk_gated_delta_rule,
         "gla": fake_chunk_gla, "simple_gla": fake_chunk_simple_gla}


@pytest.mark.parametrize("case", CASES)
def test_the_adapters_hand_fla_its_layout_and_conventions(monkeypatch, case):
    """Routed through the stand-in fla (CPU tensors let through), the entry points give the zoo's chunked results:
    outputs in v's dtype, fp32 final states, gradients for every input."""
    calls = []
    monkeypatch.setattr(fla_backend, "_loaded", {name: counted(fn, calls) for name, fn in FAKES.items()})
    args = inputs(case, n=37, d_k=8, d_v=6)
    want = forward_backward(case, args)  # the zoo's chunked kernel: CPU tensors stay on it
    monkeypatch.setattr(fla_backend, "applies", lambda q, k, v: True)
    out, final = run(case, args)
    assert calls and out.dtype == args["v"].dtype and out.shape == args["v"].shape and final.dtype == torch.float32
    got = forward_backward(case, args)
    assert_close_ratio(want, got, out_tol=5e-3, grad_tol=2e-2)  # bf16 outputs and q/k/v gradients


def test_the_entry_points_ask_the_backend_first():
    """Both kernels' modules dispatch through fla_backend (the names they imported are its functions)."""
    assert delta_rule_module.fla_kernel is fla_backend.fla_kernel
    assert gated_linear_module.fla_kernel is fla_backend.fla_kernel


# ---------------------------------------------------------------------------------------------------------------
# CUDA with fla: its kernels against the zoo's chunked kernels


def on_zoo_kernels(monkeypatch):
    monkeypatch.setenv(fla_backend.ENV, "0")


@cuda_fla
@pytest.mark.parametrize("case", CASES)
def test_cuda_fla_equals_the_chunked_kernels_bf16(monkeypatch, case):
    monkeypatch.delenv(fla_backend.ENV, raising=False)
    args = inputs(case, device="cuda")
    assert fla_backend.fla_kernel(case, args["q"], args["k"], args["v"]) is not None, "fla does not load"
    got = forward_backward(case, args)
    on_zoo_kernels(monkeypatch)
    assert fla_backend.fla_kernel(case, args["q"], args["k"], args["v"]) is None
    want = forward_backward(case, args)
    assert_close_ratio(want, got, OUT_TOL, GRAD_TOL, GATE_GRAD_TOL)


@cuda_fla
@pytest.mark.parametrize("case", CASES)
def test_cuda_fp32_stays_on_the_chunked_kernels(monkeypatch, case):
    monkeypatch.delenv(fla_backend.ENV, raising=False)
    args = inputs(case, dtype=torch.float32, device="cuda")
    assert fla_backend.fla_kernel(case, args["q"], args["k"], args["v"]) is None
    got = forward_backward(case, args)
    on_zoo_kernels(monkeypatch)
    want = forward_backward(case, args)
    assert_close_ratio(want, got, 1e-6, 1e-6)


def small_llama(name: str, **params) -> transformers.PreTrainedModel:
    """2 layers, 2 heads of 64 (1 KV head), bf16 on CUDA: head dims fla's kernels are tested at."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, intermediate_size=128, attention_dropout=0.0,
                                      pad_token_id=0)
    model = transformers.AutoModelForCausalLM.from_config(zoo.configure(config, name, **params))
    return model.to("cuda", torch.bfloat16).eval()


@cuda_fla
@pytest.mark.parametrize("name, params", [("deltanet", {}), ("gated_deltanet", {}), ("gla", {}),
                                          ("gla", {"decay": "scalar"})])
def test_cuda_variants_run_on_fla_in_a_model(monkeypatch, name, params):
    """Forward + backward of a bf16 Llama on fla equals the zoo's kernels; prefill then decode equals one forward."""
    monkeypatch.delenv(fla_backend.ENV, raising=False)
    calls = []
    for module, adapter in ((delta_rule_module, "fla_delta_rule"), (gated_linear_module, "fla_gated_linear")):
        monkeypatch.setattr(module, adapter, counted(getattr(module, adapter), calls))
    model = small_llama(name, **params)
    ids = torch.randint(3, 64, (2, 90), generator=torch.Generator().manual_seed(0)).cuda()

    def logits_and_grads():
        model.zero_grad()
        logits = model(ids).logits.float()
        logits.square().mean().backward()
        return {"logits": logits.detach(), **{f"d{n}": p.grad.float() for n, p in model.named_parameters()
                                              if p.grad is not None and "attention_zoo" in n}}

    got = logits_and_grads()
    assert calls, "the variant did not reach fla"
    mask, positions = torch.ones_like(ids), torch.arange(90, device="cuda").expand(2, -1)
    with torch.no_grad():
        cache = zoo.make_cache(model)
        steps = [(0, 80)] + [(t, t + 1) for t in range(80, 90)]
        pieces = [model(ids[:, a:b], attention_mask=mask[:, :b], position_ids=positions[:, a:b], cache=cache,
                        use_cache=True).logits for a, b in steps]
    assert_close_ratio({"logits": got["logits"]}, {"logits": torch.cat(pieces, 1).float()}, OUT_TOL, GRAD_TOL)
    on_zoo_kernels(monkeypatch)
    calls.clear()
    want = logits_and_grads()
    assert not calls
    assert_close_ratio(want, got, OUT_TOL, GATE_GRAD_TOL)
