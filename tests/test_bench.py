"""`zoo bench`: outputs, every registered variant and installed peer present, skips noted, failures recorded,
the exponent fit and the budget estimates, flag aliases and attention dropout."""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

import zoo
from zoo import bench
from zoo.bench import PEERS, QKVProjections, plan
from zoo.cli import build_parser, main

OUTPUTS = ("bench.csv", "bench.json", "bench.md", "time_vs_n.png", "memory_vs_n.png")


class RaisingVariant(zoo.Variant):
    """A variant whose kernel always fails: the benchmark must record it and go on."""

    name = "bench_test_raises"

    def attend(self, q, k, v, call):
        raise RuntimeError("boom from the test variant")


class MemoryHogVariant(zoo.Variant):
    """Asks for more memory than the machine has (never touching it): the cap must turn that into an error."""

    name = "bench_test_hog"

    def attend(self, q, k, v, call):
        torch.empty(int(0.95 * bench.available_memory_bytes(bench.BenchSettings())), dtype=torch.uint8)
        return q


def read_rows(out):
    with open(out / "bench.csv") as handle:
        return list(csv.DictReader(handle))


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_quick")
    assert main(["bench", "--quick", "--no_progress", "--output_dir", str(out)]) == 0
    return out


def test_quick_writes_every_output(quick_run):
    for name in OUTPUTS:
        assert (quick_run / name).stat().st_size > 0, name
    for plot in ("time_vs_n.png", "memory_vs_n.png"):
        assert (quick_run / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    markdown = (quick_run / "bench.md").read_text()
    for section in ("## Time (s)", "## Peak memory", "## Against sdpa", "## Against the matching peer",
                    "## The O(n²) wall"):
        assert section in markdown
    # Two single-repeat lengths: no exponents (any slope fits two points), no wall table; the report says why.
    assert "this run measured 2, so the exponents are omitted" in markdown
    assert "Omitted: no contestant was measured at two of n = 512, 2048" in markdown
    assert "theoretical relative cost" not in markdown
    report = json.loads((quick_run / "bench.json").read_text())
    assert all(info["time_exponent"] is None for info in report["variants"].values())


def test_quick_covers_every_registered_variant_and_installed_peer(quick_run):
    rows = read_rows(quick_run)
    installed_peers = {name for name, peer in PEERS.items() if peer.installed()}
    assert {"hf_longformer", "hf_bigbird"} <= installed_peers  # transformers is a dependency
    expected = set(zoo.list_variants()) | installed_peers
    lengths = {"512", "1024"}
    for name in expected:
        assert {r["n"] for r in rows if r["variant"] == name} == lengths, name


def test_quick_measures_real_numbers(quick_run):
    rows = {(r["variant"], int(r["n"])): r for r in read_rows(quick_run)}
    report = json.loads((quick_run / "bench.json").read_text())
    for n in (512, 1024):
        sdpa = rows[("sdpa", n)]
        assert sdpa["status"] == "ok"
        assert float(sdpa["time_s"]) > 0
        assert float(sdpa["peak_mb"]) > report["baseline_rss_mb"] > 50  # torch is imported in the idle process
        assert float(sdpa["speedup_vs_sdpa"]) == pytest.approx(1.0)
        assert float(sdpa["gflop_per_s"]) > 0
    # Eager dense materializes n x n scores: it needs more memory than SDPA's flash-style kernel.
    assert float(rows[("dense", 1024)]["mem_mb"]) > float(rows[("sdpa", 1024)]["mem_mb"])
    assert report["roof_gflop_per_s"] > 0
    assert report["variants"]["sdpa"]["time_exponent"] is None  # two lengths: no slope is fitted through 2 points


def test_quick_errors_against_the_dense_reference(quick_run):
    variants = json.loads((quick_run / "bench.json").read_text())["variants"]
    exact = ["sdpa", "hf_longformer"] + (["local_attention"] if "local_attention" in variants else [])
    for name in exact:
        assert variants[name]["rel_error"] < 1e-4, name
    if "performer_pytorch" in variants:  # approximate: a real, nonzero error against full softmax
        assert 0 < variants["performer_pytorch"]["rel_error"] < 2
    assert variants["hf_bigbird"]["rel_error"] is None and variants["hf_bigbird"]["error_note"].startswith("n/a")


def test_quick_notes_hf_bigbird_full_attention_fallback(quick_run):
    rows = {(r["variant"], int(r["n"])): r for r in read_rows(quick_run)}
    assert rows[("hf_bigbird", 512)]["status"] == "skipped"
    assert "full attention" in rows[("hf_bigbird", 512)]["note"]
    assert rows[("hf_bigbird", 1024)]["status"] == "ok"


def test_failing_variants_are_recorded_and_budget_skips_are_noted(tmp_path):
    zoo.register_variant(RaisingVariant)
    zoo.register_variant(MemoryHogVariant)
    try:
        code = main([
            "bench", "--variants", "sdpa", "bench_test_raises", "bench_test_hog", "--lengths", "512", "1024",
            "--hidden", "64", "--heads", "2", "--repeats", "1", "--warmup", "0", "--max-seconds", "1e-6",
            "--error-length", "256", "--roof-size", "128", "--no-progress", "--output-dir", str(tmp_path),
        ])  # the hyphenated aliases of the flags
    finally:
        zoo.unregister_variant(RaisingVariant.name)
        zoo.unregister_variant(MemoryHogVariant.name)
    assert code == 0
    rows = {(r["variant"], int(r["n"])): r for r in read_rows(tmp_path)}
    assert rows[("sdpa", 512)]["status"] == "ok"
    assert rows[("sdpa", 1024)]["status"] == "skipped"
    assert "> --max_seconds 1e-06" in rows[("sdpa", 1024)]["note"]
    for n in (512, 1024):
        assert rows[("bench_test_raises", n)]["status"] == "error"
        assert "RuntimeError: boom from the test variant" in rows[("bench_test_raises", n)]["note"]
    assert rows[("bench_test_hog", 512)]["status"] == "error"
    assert "can't allocate memory" in rows[("bench_test_hog", 512)]["note"]
    assert rows[("bench_test_hog", 1024)]["note"].startswith("skipped: failed at n=512")
    markdown = (tmp_path / "bench.md").read_text()
    assert "skipped: est." in markdown and "boom from the test variant" in markdown
    for name in OUTPUTS:
        assert (tmp_path / name).exists()


def _synthetic_report(lengths):
    from zoo.bench.report import assemble_report

    settings = bench.BenchSettings(lengths=lengths)
    contestants = bench.make_contestants(["sdpa"], {})
    rows = [{"variant": "sdpa", "n": n, "status": "ok", "note": "", "time_s": 1e-8 * n * n, "mem_mb": 1e-5 * n * n,
             "gflop_per_s": 1.0} for n in lengths]
    return assemble_report(settings, contestants, rows, {}, {"status": "error", "error": "not measured"}, 0)


def test_exponents_and_the_wall_need_enough_lengths():
    from zoo.bench.report import render_markdown

    few, enough = _synthetic_report([512, 1024]), _synthetic_report([512, 1024, 2048])
    assert few["variants"]["sdpa"]["time_exponent"] is None
    assert enough["variants"]["sdpa"]["time_exponent"] == pytest.approx(2.0)
    assert "theoretical relative cost" not in render_markdown(few, "zoo bench")
    text = render_markdown(enough, "zoo bench")
    assert "theoretical relative cost" in text and "time 16.0x" in text and "exponents are omitted" not in text


def test_fit_exponent_on_synthetic_numbers():
    lengths = [512, 1024, 2048, 4096, 8192, 16384, 32768]
    assert bench.fit_exponent(lengths, [3e-9 * n**2 for n in lengths]) == pytest.approx(2.0)
    # Lengths >= 4096 only, when present: fixed overheads at small n must not bend the fit.
    times = [0.5 if n < 4096 else 1e-4 * n**1.1 for n in lengths]
    assert bench.fit_exponent(lengths, times) == pytest.approx(1.1)
    # Fewer than two large lengths: fit over all of them.
    assert bench.fit_exponent([512, 1024, 4096], [1.0, 2.0, 8.0]) == pytest.approx(1.0)
    assert bench.fit_exponent([512], [1.0]) is None
    assert bench.fit_exponent([512, 1024], [1.0, None]) is None


def test_skip_reason_extrapolates_time_and_memory(monkeypatch):
    settings = bench.BenchSettings(max_seconds=60)
    sdpa = bench.make_contestants(["sdpa"], {})[0]
    history = bench.History(times=[(1024, 1.0), (2048, 4.0)], memory=[(1024, 1e8), (2048, 2e8)])
    note, estimate = bench.skip_reason(sdpa, settings, 8192, history, baseline=3e8)
    assert estimate == pytest.approx(64.0)  # slope 2 from the last two lengths
    assert note == "skipped: est. 64 s > --max_seconds 60"
    monkeypatch.setattr(plan, "available_memory_bytes", lambda settings: 1e9)
    roomy = bench.BenchSettings(max_seconds=1e9)
    assert bench.skip_reason(sdpa, roomy, 4096, history, baseline=3e8)[0] is None  # 4e8 + 3e8 fits in 0.9e9
    note, _ = bench.skip_reason(sdpa, roomy, 16384, history, baseline=3e8)  # 16e8 + 3e8 does not
    assert note == "skipped: est. 1.8 GB > 953.7 MB available"
    history.failed_at, history.failure = 2048, "the measuring process died"
    note, _ = bench.skip_reason(sdpa, bench.BenchSettings(max_seconds=1e9), 4096, history, baseline=0)
    assert note == "skipped: failed at n=2048 (the measuring process died)"


def test_first_estimate_uses_the_cost_model():
    settings = bench.BenchSettings()
    sdpa = bench.make_contestants(["sdpa"], {})[0]
    history = bench.History(times=[(1024, 1.0)])
    _, estimate = bench.skip_reason(sdpa, settings, 2048, history, baseline=0)
    expected = bench.total_flops(sdpa, settings, 2048) / bench.total_flops(sdpa, settings, 1024)
    assert estimate == pytest.approx(expected)
    assert 2 < expected < 4  # quadratic attention plus linear projections


def test_variant_params_parse_and_link_to_peers():
    parsed = bench.parse_variant_params(["longformer.window=256", "longformer.global_tokens=[0,5]", "x.mode=fast"])
    assert parsed == {"longformer": {"window": 256, "global_tokens": [0, 5]}, "x": {"mode": "fast"}}
    with pytest.raises(ValueError, match="NAME.KEY=VALUE"):
        bench.parse_variant_params(["window=256"])
    hf = PEERS["hf_longformer"]({}, parsed)
    assert hf.params == {"window": 256, "global_tokens": [0, 5]}
    assert PEERS["local_attention"]({}, parsed).params["window"] == 128  # each side
    assert PEERS["hf_longformer"]({"window": 64}, parsed).params["window"] == 64  # the peer's own override wins
    with pytest.raises(zoo.VariantParameterError, match="no parameter 'nope'"):
        PEERS["hf_bigbird"]({"nope": 1})


def test_bad_input_gives_a_clear_error(capsys, tmp_path):
    assert main(["bench", "--hidden", "100", "--heads", "12", "--output_dir", str(tmp_path)]) == 2
    assert "not divisible by --heads" in capsys.readouterr().err
    assert main(["bench", "--variants", "no_such_variant", "--output_dir", str(tmp_path)]) == 2
    assert "unknown variant or peer 'no_such_variant'" in capsys.readouterr().err
    assert main(["bench", "--variant_params", "dense.nope=1", "--output_dir", str(tmp_path)]) == 2
    assert "no parameter 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "bench.csv").exists()


@pytest.mark.parametrize(
    "flags",
    [
        ["--heads", "0"], ["--batch", "0"], ["--threads", "-1"], ["--threads", "0"], ["--hidden", "0"],
        ["--lengths", "512", "0"], ["--repeats", "0"], ["--warmup", "-1"], ["--max_seconds", "0"],
        ["--max_seconds", "nan"], ["--error_length", "0"], ["--roof_size", "-5"], ["--dropout", "1.5"],
        ["--dropout", "-0.1"], ["--heads", "two"], ["--decode", "--new_tokens", "2"], ["--decode", "--window", "0"],
        ["--decode", "--heads", "0"],
    ],
)
def test_every_numeric_flag_is_validated_naming_the_flag(flags, capsys, tmp_path):
    """Refused by argparse (exit status 2) before anything runs: `--heads 0` used to exit 0 and record 12."""
    with pytest.raises(SystemExit) as exited:
        main(["bench", *flags, "--output_dir", str(tmp_path)])
    assert exited.value.code == 2
    flag = next(f for f in reversed(flags) if f.startswith("--"))
    assert f"argument {flag}" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_the_report_command_spells_out_the_settings_used():
    from zoo.bench.cli import command_line, settings_from_args

    flags = ["--heads", "4", "--hidden", "64", "--threads", "1", "--roof_size", "256"]
    args = build_parser().parse_args(["bench", *flags])
    args.output_dir = "out"
    settings = settings_from_args(args)
    assert (settings.heads, settings.hidden, settings.threads, settings.roof_size) == (4, 64, 1, 256)
    command = command_line(settings, args)
    assert "--hidden 64 --heads 4" in command and "--threads 1" in command and "--roof_size 256" in command


@pytest.mark.parametrize("name", ["hf_longformer", "local_attention", "hf_bigbird", "performer_pytorch"])
def test_peer_layers_share_the_projections_and_keep_shapes(name):
    if not PEERS[name].installed():
        pytest.skip(f"{PEERS[name].distribution} is not installed")
    peer = PEERS[name]()
    proj = QKVProjections(64, 4)
    n = 1000  # not a multiple of the window or block: the peer pads like its model does
    layer = peer.build(proj, n, causal=False).eval()
    assert {id(p) for p in proj.parameters()} <= {id(p) for p in layer.parameters()}
    x = torch.randn(2, n, 64)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == x.shape and torch.isfinite(out).all()


def test_zoo_layers_carry_the_variants_learned_weights():
    """A variant with per-layer weights gets them in the benchmark layer, trained like its projections."""
    contestant = bench.make_contestants(["nystromformer"], {"nystromformer": {"conv_kernel_size": 5}})[0]
    layer = contestant.build(QKVProjections(32, 2), 200, causal=False)
    assert layer.weights.conv.weight.shape == (2, 1, 5, 1)
    layer(torch.randn(1, 200, 32)).sum().backward()
    assert layer.weights.conv.weight.grad.abs().sum() > 0
    assert bench.make_contestants(["nystromformer"], {})[0].build(QKVProjections(32, 2), 200, False).weights is None


def test_in_process_runner_records_failures():
    """The CUDA path runs measurements in-process; a failure there is recorded the same way."""
    settings = bench.BenchSettings(lengths=[64], hidden=32, heads=2, repeats=2, warmup=0)
    contestants = bench.make_contestants(["sdpa"], {})
    runner = bench.Runner(settings, contestants)
    runner.isolated = False
    result = runner.run(bench.measure_time, contestants[0], settings, 64, timeout=60)
    assert result["status"] == "ok" and len(result["times"]) == 2 and all(t > 0 for t in result["times"])
    failing = bench.ZooContestant(RaisingVariant, {})
    result = runner.run(bench.measure_time, failing, settings, 64, timeout=60)
    assert result == {"status": "error", "error": "RuntimeError: boom from the test variant"}
    assert math.isfinite(runner.run(bench.measure_roof, settings, timeout=60)["gflop_per_s"])


def test_flags_take_underscores_and_hyphens_alike():
    """One spelling across zoo bench, finetune and compare (--output_dir, the Hugging Face one); hyphens still work."""
    underscores = build_parser().parse_args([
        "bench", "--output_dir", "a", "--max_seconds", "5", "--error_length", "64", "--roof_size", "32",
        "--variant_params", "longformer.window=64", "--no_progress",
    ])
    hyphens = build_parser().parse_args([
        "bench", "--output-dir", "a", "--max-seconds", "5", "--error-length", "64", "--roof-size", "32",
        "--variant-params", "longformer.window=64", "--no-progress",
    ])
    assert vars(underscores) == vars(hyphens)
    assert underscores.max_seconds == 5.0 and underscores.no_progress and str(underscores.output_dir) == "a"
    settings = bench.settings_from_args(underscores)
    command = bench.command_line(settings, underscores)
    assert "--max_seconds 5 --error_length 64" in command and command.endswith("--output_dir a")
    assert "--dropout" not in command  # written only when set


@pytest.mark.parametrize("name", ["sdpa", "longformer", "hf_longformer", "local_attention"])
def test_dropout_reaches_the_attention_in_training_mode(name):
    contestant = bench.make_contestants([name], {})[0]
    if not getattr(contestant, "installed", lambda: True)():
        pytest.skip(f"{name} is not installed")
    assert contestant.supports_dropout
    n, x = 256, torch.randn(1, 256, 32)
    with_dropout = contestant.build(QKVProjections(32, 2), n, causal=False, dropout=0.5).train()
    torch.manual_seed(1)
    first = with_dropout(x)
    torch.manual_seed(2)
    assert not torch.allclose(first, with_dropout(x))  # different dropout masks
    without = contestant.build(QKVProjections(32, 2), n, causal=False).train()
    assert torch.equal(without(x), without(x))
    with_dropout.eval()
    assert torch.equal(with_dropout(x), with_dropout(x))  # eval: no dropout


def test_dropout_runs_in_training_mode_and_skips_contestants_without_it(tmp_path):
    settings = bench.BenchSettings(lengths=[64], hidden=32, heads=2, mode="fwd", dropout=0.1)
    assert settings.training and not bench.BenchSettings(mode="fwd").training
    performer, hf_bigbird = bench.make_contestants(["performer", "hf_bigbird"], {})
    assert not performer.supports_dropout and not hf_bigbird.supports_dropout
    note, _ = bench.skip_reason(performer, settings, 2048, bench.History(), baseline=0)
    assert note == "skipped: performer has no attention dropout (--dropout 0.1)"
    assert main([
        "bench", "--variants", "sdpa", "performer", "--lengths", "256", "--hidden", "32", "--heads", "2",
        "--repeats", "1", "--warmup", "0", "--error_length", "128", "--roof_size", "64", "--dropout", "0.1",
        "--no_progress", "--output_dir", str(tmp_path),
    ]) == 0
    rows = {r["variant"]: r for r in read_rows(tmp_path)}
    assert rows["sdpa"]["status"] == "ok" and float(rows["sdpa"]["time_s"]) > 0
    assert rows["performer"]["status"] == "skipped"
    assert rows["performer"]["note"] == "skipped: performer has no attention dropout (--dropout 0.1)"
    assert {r["dropout"] for r in rows.values()} == {"0.1"}
    report = json.loads((tmp_path / "bench.json").read_text())
    assert report["settings"]["dropout"] == 0.1 and "--dropout 0.1" in report["command"]
    assert report["variants"]["performer"]["rel_error"] is not None  # the error check runs in eval mode
    markdown = (tmp_path / "bench.md").read_text()
    assert "fwd+bwd with attention dropout 0.1 (training mode)" in markdown
    assert "(eval mode: no dropout)" in markdown


# ---------------------------------------------------------------------------------------------------
# zoo bench --decode


def test_decode_measures_per_token_time_and_cache_bytes_through_generate():
    from zoo.bench.decode import DecodeContestant, DecodeSettings, measure_decode

    settings = DecodeSettings(lengths=[48], new_tokens=4, rounds=2, window=16, hidden=32, heads=2, kv_heads=1)
    peers = [DecodeContestant("transformers_sdpa", "peer"), DecodeContestant("mistral_sliding_window", "peer")]
    result = measure_decode(peers, settings, 48)
    dense, mistral = result["results"]["transformers_sdpa"], result["results"]["mistral_sliding_window"]
    assert dense["ms_per_token"] > 0 and dense["first_token_s"] > 0 and len(dense["round_ms"]) == 2
    # 2 layers x (k + v) x 1 kv head x 32/2 dims x fp32 per token in the cache: the prompt, then each round's
    # tokens (the last one generated is not fed back)
    assert dense["cache_bytes"] == 2 * 2 * 1 * 16 * 4 * (48 + 2 * 4)
    assert mistral["cache_bytes"] < dense["cache_bytes"] / 2  # the sliding window keeps about 16 keys


def test_decode_takes_turns_and_continues_each_sequence_as_one_generate_would(monkeypatch):
    """Every contestant prefills once, then the rounds alternate their order (A B, B A, ...), each round
    continuing the contestant's own sequence and cache: the tokens equal one uninterrupted generate."""
    import zoo.bench.decode as decode

    settings = decode.DecodeSettings(lengths=[40], new_tokens=3, rounds=3, window=8, hidden=32, heads=2, kv_heads=1)
    contestants = [decode.DecodeContestant("mistral_sliding_window", "peer"),
                   decode.DecodeContestant("longformer", "zoo", "longformer", decode.decode_params("longformer", 8))]
    calls, sequences, real_generate = [], {}, decode._generate

    def recording(model, ids, new_tokens, **options):
        out = real_generate(model, ids, new_tokens, **options)
        calls.append((model.config.model_type, ids.shape[1], new_tokens))
        sequences[model.config.model_type] = (model, out.sequences)
        return out

    monkeypatch.setattr(decode, "_generate", recording)
    results = decode.measure_decode(contestants, settings, 40)["results"]
    timed = [(kind, length) for kind, length, new in calls if new == 3]
    assert timed == [("mistral", 41), ("llama", 41), ("llama", 44), ("mistral", 44), ("mistral", 47), ("llama", 47)]
    for model, tokens in sequences.values():
        with torch.inference_mode():
            whole = real_generate(model, tokens[:, :40], 1 + 3 * 3).sequences
        assert torch.equal(tokens, whole)
    assert all(len(r["round_ms"]) == 3 and r["status"] == "ok" for r in results.values())


def test_decode_records_a_contestant_that_raises_and_measures_the_others(monkeypatch):
    import zoo.bench.decode as decode

    settings = decode.DecodeSettings(lengths=[40], new_tokens=3, rounds=2, window=8, hidden=32, heads=2, kv_heads=1)
    real_build = decode.build_model

    def failing(contestant, settings, n):
        if contestant.name == "xformers":
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
        return real_build(contestant, settings, n)

    monkeypatch.setattr(decode, "build_model", failing)
    contestants = [decode.DecodeContestant("xformers", "zoo", "xformers", {"window": 8}),
                   decode.DecodeContestant("transformers_sdpa", "peer")]
    results = decode.measure_decode(contestants, settings, 40)["results"]
    assert results["xformers"] == {"status": "error", "seconds": results["xformers"]["seconds"],
                                   "error": "RuntimeError: DefaultCPUAllocator: can't allocate memory"}
    assert results["transformers_sdpa"]["status"] == "ok" and len(results["transformers_sdpa"]["round_ms"]) == 2


def test_decode_compares_with_a_peer_by_the_medians_over_all_rounds_and_shows_single_rounds_beside():
    from zoo.bench.decode import speedup

    peer = {"ms_per_token": 4.0, "round_ms": [2.0, 2.0, 6.0, 6.0, 6.0]}
    mine = {"ms_per_token": 3.8, "round_ms": [1.9, 1.9, 1.9, 5.7, 5.7]}  # a slow stretch lands on other rounds
    assert speedup(mine, peer) == pytest.approx((4.0 / 3.8, 2.0 / 1.9, 6.0 / 1.9))
    report = {"settings": {"lengths": [64], "rounds": 5}, "contestants": {"mine": {}, "peer": {}}, "rows": [
        {"variant": "mine", "n": 64, "status": "ok", "cache_mb": 1.0, **mine},
        {"variant": "peer", "n": 64, "status": "ok", "cache_mb": 4.0, **peer}]}
    from zoo.bench.decode import _versus_table

    assert _versus_table(report, "peer")[-1] == "| mine | 1.05x (1.05–3.16), 0.25 of cache |"


def test_decode_measures_each_contestant_alone_when_the_shared_process_dies(monkeypatch):
    from zoo.bench import decode
    from zoo.bench.measure import Runner

    settings = decode.DecodeSettings(lengths=[40], new_tokens=3, rounds=1, window=8, hidden=32, heads=2, kv_heads=1)
    contestants = [decode.DecodeContestant("transformers_sdpa", "peer"),
                   decode.DecodeContestant("mistral_sliding_window", "peer")]
    real_run, sizes = Runner.run, []

    def dying_together(self, fn, *args, timeout):
        if fn is decode.measure_decode:
            sizes.append(len(args[0]))
            if len(args[0]) > 1:
                return {"status": "error", "error": "the measuring process died: killed (SIGKILL)", "fatal": True}
        return real_run(self, fn, *args, timeout=timeout)

    monkeypatch.setattr(Runner, "run", dying_together)
    report = decode.run_decode_benchmark(settings, contestants, progress=False)
    assert sizes == [2, 1, 1]
    assert [r["status"] for r in report["rows"]] == ["ok", "ok"]
    assert all(r["note"].startswith("measured alone (the shared process: the measuring process died")
               for r in report["rows"])
    assert "measured alone" in decode.render_markdown(report, "zoo bench --decode")


def _reaches_itself(root) -> bool:
    """Whether ``root`` is reachable from its own attributes, lists, tuples and dicts (a reference cycle that a
    recursive walker of attributes -- the decode benchmark's old byte counter -- never leaves)."""
    seen, stack = set(), [value for value in vars(root).values()]
    while stack:
        obj = stack.pop()
        if obj is root:
            return True
        if id(obj) in seen or isinstance(obj, (torch.Tensor, torch.nn.Module, type)):
            continue
        seen.add(id(obj))
        if isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif hasattr(obj, "__dict__") and not callable(obj):
            stack.extend(vars(obj).values())
    return False


def test_decode_counts_a_windowed_cache_with_zoo_cache_nbytes_and_its_layers_hold_no_cycle():
    """The README's decode rows (longformer + sinks, xformers with a window) measure: their cache layers keep no
    reference to themselves and the bytes are zoo.cache_nbytes' (issue 29, item 5)."""
    from zoo.bench.decode import DecodeContestant, DecodeSettings, decode_params, measure_decode

    settings = DecodeSettings(lengths=[48], new_tokens=4, rounds=1, window=16, hidden=32, heads=2, kv_heads=1)
    contestants = [DecodeContestant(name, "zoo", name, decode_params(name, 16)) for name in ("longformer", "xformers")]
    for name, result in measure_decode(contestants, settings, 48)["results"].items():
        assert result["status"] == "ok" and 0 < result["cache_bytes"] < 2 * 2 * 16 * 4 * 51, name
    model = zoo.configure(transformers_llama(), "longformer", window=8, global_tokens=[0, 1])
    model = __import__("transformers").AutoModelForCausalLM.from_config(model).eval()
    ids = torch.randint(3, 64, (1, 30))
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    for layer in out.past_key_values.layers:
        assert not _reaches_itself(layer)
    assert zoo.cache_nbytes(out.past_key_values) > 0


def transformers_llama():
    import transformers

    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, intermediate_size=64, pad_token_id=0)


def test_decode_cli_refuses_a_variant_without_causal_support_and_writes_reports(tmp_path, capsys):
    from zoo.cli import main

    assert main(["bench", "--decode", "--variants", "no_such_variant", "--output_dir", str(tmp_path)]) == 2
    assert "neither a causal variant" in capsys.readouterr().err
    code = main(["bench", "--decode", "--variants", "transformers_sdpa", "sdpa", "--lengths", "40", "64",
                 "--new_tokens", "3", "--hidden", "32", "--heads", "2", "--output-dir", str(tmp_path), "--no_progress"])
    assert code == 0
    text = (tmp_path / "decode.md").read_text()
    assert "Milliseconds per generated token" in text and "vs transformers_sdpa" in text
    assert (tmp_path / "decode_ms_per_token.png").stat().st_size > 0


def test_decode_shows_a_documented_refusal_as_skipped_with_its_reason():
    """reformer refuses a KV cache by design: that is a skip with the reason, not an error."""
    from zoo.bench.decode import DecodeContestant, DecodeSettings, decode_params, run_decode_benchmark

    settings = DecodeSettings(lengths=[40], new_tokens=3, hidden=32, heads=2, kv_heads=1)
    reformer = DecodeContestant("reformer", "zoo", "reformer", decode_params("reformer", settings.window))
    report = run_decode_benchmark(settings, [reformer], progress=False)
    (row,) = report["rows"]
    assert row["status"] == "skipped"
    assert row["note"].startswith("skipped: cannot decode with a KV cache: its keys are the queries")
