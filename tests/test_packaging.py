"""The install layout (no top-level ``variants`` module to collide with PyPI's) and models saved by 0.1.0."""

import configparser
import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
import transformers

import zoo

ROOT = Path(__file__).resolve().parents[1]
SAVED_0_1_0 = Path(__file__).parent / "data" / "saved_0_1_0"


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> tuple[list[str], str]:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("attention_zoo-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        entry_points = next(archive.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    return names, entry_points


def test_the_wheel_installs_only_the_zoo_package(wheel_files):
    names, _ = wheel_files
    top_level = {name.split("/")[0] for name in names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"zoo"}, f"the wheel would install top-level modules {sorted(top_level - {'zoo'})}"
    sources = [f"zoo/{p.relative_to(ROOT / 'zoo').as_posix()}" for p in (ROOT / "zoo").rglob("*.py")]
    variants = ROOT / "variants"
    variants = ROOT / "variants"
    sources += [f"zoo/variants/{p.relative_to(variants).as_posix()}" for p in variants.rglob("*.py")]
    missing = sorted(set(sources) - set(names))
    assert not missing, f"the wheel lacks {missing}: add the package to [tool.setuptools] packages in pyproject.toml"


def test_built_in_entry_points_name_zoo_variants(wheel_files):
    _, entry_points = wheel_files
    parser = configparser.ConfigParser()
    parser.read_string(entry_points)
    targets = list(parser["attention_zoo.variants"].values())
    assert targets and all(t.startswith("zoo.variants.") for t in targets), targets


@pytest.mark.parametrize("name", ["sparse_transformer", "longformer"])
def test_models_saved_by_0_1_0_load_with_the_same_outputs(name):
    """config.json written by attention-zoo 0.1.0 (variant name + params, no module path) still loads."""
    expected = json.loads((SAVED_0_1_0 / "expected.json").read_text())
    model = transformers.AutoModelForSequenceClassification.from_pretrained(SAVED_0_1_0 / name).eval()
    assert zoo.variant_spec(model.config)["variant"] == name
    with torch.no_grad():
        logits = model(
            input_ids=torch.tensor(expected["input_ids"]), attention_mask=torch.tensor(expected["attention_mask"])
        ).logits
    torch.testing.assert_close(logits, torch.tensor(expected["logits"][name]), atol=1e-5, rtol=1e-5)


def test_every_package_folder_is_listed_so_setuptools_builds_quietly():
    """A folder holding .py files that pyproject.toml does not list makes setuptools print a BuildBackendWarning
    ("Package 'zoo.metrics.accuracy' is absent from the packages configuration") on every install."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {p.parent for p in (ROOT / "zoo").rglob("*.py") if "__pycache__" not in p.parts}
    packages = {".".join(folder.relative_to(ROOT).parts) for folder in folders}
    packages |= {"zoo.variants." + ".".join(p.parent.relative_to(ROOT / "variants").parts) for p in
                 (ROOT / "variants").rglob("*.py") if p.parent != ROOT / "variants"}
    assert packages - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


SAVED_BEFORE_LAYOUT = Path(__file__).parent / "data" / "saved_main_0_1_0_layout"


@pytest.mark.parametrize("name", ["longformer", "linformer", "hybrid"])
def test_models_saved_before_the_package_layout_changed_load_with_the_same_outputs(name):
    """Saved by main before zoo/ moved into plug/, training/, hub/... (3380d2b): config.json stores variant names and
    parameters, learned weights sit under ``attention_zoo.``, so a module move changes nothing a checkpoint holds."""
    expected = json.loads((SAVED_BEFORE_LAYOUT / "expected.json").read_text())
    ids, mask = torch.tensor(expected["input_ids"]), torch.tensor(expected["attention_mask"])
    auto = transformers.AutoModelForCausalLM if name == "hybrid" else transformers.AutoModelForSequenceClassification
    model = auto.from_pretrained(SAVED_BEFORE_LAYOUT / name).eval()
    assert zoo.variant_spec(model.config)["variant"] == name
    with torch.no_grad():
        if name == "hybrid":
            got = model(input_ids=ids, attention_mask=mask).logits[:, -1]
            generated = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
            assert generated.tolist() == expected["generated"]
        else:
            got = model(input_ids=ids, attention_mask=mask.flip(-1)).logits
    torch.testing.assert_close(got, torch.tensor(expected["outputs"][name]), atol=1e-5, rtol=1e-5)
