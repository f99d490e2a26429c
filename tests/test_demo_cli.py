"""What a newcomer meets first: `specbus demo`'s input checks, `--version`, `specbus feed`
telling why it waits, the progress lines and the summary's TensorBoard hook."""

from __future__ import annotations

import io
import os
import time

import pytest
from specbus.core.config import dump_config
from specbus.ops.cli import main
from specbus.ops.launch import Launcher

from tests.fixtures.pipeline import pipeline_config, write_tokenised_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--config", "{tmp}/missing.yaml"], "does not exist"),
        (["--config", "{tmp}/bad.yaml"], "is not valid YAML"),
        (["--data", "{tmp}/missing.jsonl"], "missing.jsonl"),
        (["--trainers", "0"], "at least one of each"),
        (["data.holdout=0"], "hold some back"),
    ],
)
def test_demo_reports_bad_inputs_before_starting_anything(tmp_path, capsys, argv, says):
    (tmp_path / "bad.yaml").write_text("a: [\n")
    argv = [a.format(tmp=tmp_path) for a in argv]
    code = main(["demo", *argv, f"run_dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert code == 2 and says in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing was started


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.startswith("specbus ")


def test_feed_says_it_waits_for_producers_and_why(tmp_path, tiny_target, nats_server, run_id):
    data = write_tokenised_data(tmp_path / "data.jsonl", 300)
    cfg = pipeline_config(run_id, tmp_path / "run", tiny_target, data,
                          store_uri=f"shm://{run_id}", overrides=["bus.max_ack_pending=2"])  # fmt: skip
    path = tmp_path / "run.yaml"
    path.write_text(dump_config(cfg))
    procs = Launcher(tmp_path / "logs", cwd=ROOT)
    try:
        feeder = procs.start("feeder", ["feed", "--config", str(path), "--url", nats_server.url])
        deadline = time.monotonic() + 600  # a loaded 2-core machine
        while "waiting for producers" not in procs.log("feeder"):
            assert feeder.poll() is None, procs.log("feeder")
            assert time.monotonic() < deadline, procs.log("feeder")
            time.sleep(0.1)
    finally:
        procs.stop()
    out = procs.log("feeder")  # one batch of 256 published, then held back by the lag
    assert "published 256 of 300 tasks; waiting for producers: 256 tasks not yet captured" in out
    assert "at most 8 tasks ahead" in out and "specbus produce" in out


def test_plain_progress_lines(tmp_path):
    from specbus.ops.progress import phase

    out = io.StringIO()
    with phase("decoding", 4, "prompts", stream=out, every_s=0) as p:
        p.update(2, info="half")
    lines = out.getvalue().splitlines()
    assert lines[0] == "decoding..."
    assert lines[1].startswith("decoding: 2/4 prompts (50%), ETA ") and lines[1].endswith("| half")
    assert lines[-1].startswith("decoding: done in ")


def test_the_summary_says_what_ran_and_where_things_are(tmp_path):
    import argparse
    import json

    from specbus.core.config import build_config
    from specbus.core.eval.speculative import AcceptanceReport
    from specbus.ops.demo import summary
    from specbus.ops.evaluate import Comparison

    cfg = build_config({"run": "s", "run_dir": str(tmp_path)}, [])
    (tmp_path / "logs").mkdir()
    rows = [{"step": 5, "samples_per_s": 1.0, "data_wait_frac": 0.1},
            {"step": 10, "samples_per_s": 3.0, "data_wait_frac": 0.3},
            {"final": 1, "steps": 10, "samples": 20}]  # fmt: skip
    (tmp_path / "logs" / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = lambda length: AcceptanceReport(20, 60, 64, length - 1, length, True)  # noqa: E731
    args = argparse.Namespace(producers=1, trainers=2)
    text = summary(cfg, args, Comparison(report(1.0), report(1.25), 3), tmp_path / "export",
                   {"target": 3, "training": 200, "evaluation": 90, "total": 293},
                   url_was_embedded=True)  # fmt: skip
    assert "done in 4.9 min (target 3s, training 200s, evaluation 90s)" in text
    assert "10 steps, 20 samples" in text  # each rank logs its own rate: 2 ranks x 2.00
    assert "4.00 samples/s over 2 rank(s) (2.00 per rank), data wait 20%" in text
    assert "untrained 1.000 -> trained 1.250" in text and str(tmp_path / "export") in text
    assert "tensorboard" not in text
    (tmp_path / "tb").mkdir()
    text = summary(cfg, args, Comparison(report(1.0), report(1.25), 3), tmp_path / "export",
                   {"total": 1}, url_was_embedded=True)  # fmt: skip
    assert f"tensorboard --logdir {tmp_path / 'tb'}" in text


def test_conversion_steps_report_forward_and_replace_transformers_tensor_bar():
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from specbus.core.models.gguf_convert import _STEPS, _Steps, _tensor_progress

    heard = []
    steps = _Steps(lambda done, total, what: heard.append((done, total, what)))
    steps.begin("importing transformers")
    steps.begin("reading the weights")
    original = gguf_utils.tqdm
    with _tensor_progress(steps):  # what transformers iterates its GGUF tensors with
        assert list(gguf_utils.tqdm(["a", "b", "c", "d"], desc="Converting...")) == list("abcd")
    assert gguf_utils.tqdm is original
    steps.begin("reading the weights")  # a step again: never backwards
    steps.end()
    total = sum(_STEPS.values())
    dequant = [d for d, _, w in heard if w == "de-quantising the tensors"]
    assert len(dequant) == 5  # the step's start, then one report per tensor
    names = list(_STEPS)
    start = sum(_STEPS[n] for n in names[: names.index("de-quantising the tensors")])
    assert dequant[0] == start and dequant[-1] == start + _STEPS["de-quantising the tensors"]
    done = [d for d, _, _ in heard]
    assert done == sorted(done) and done[-1] == total and {t for _, t, _ in heard} == {total}


@pytest.mark.slow
def test_target_preparation_shows_progress_with_eta(tmp_path, capfd):
    """The cold GGUF conversion (46-139 s on 2 cores) as `specbus demo` runs it, output not a
    terminal: plain lines through every step with an ETA, no third-party bar anywhere."""
    import re

    from specbus.core.models.target import SMOLLM2
    from specbus.ops.demo import prepare_target

    out = io.StringIO()
    log = tmp_path / "target.log"
    path = prepare_target(SMOLLM2, tmp_path / "cache", log, stream=out, every_s=0)
    assert (path / "specbus_target.json").is_file() and path.is_relative_to(tmp_path)
    lines = out.getvalue().splitlines()
    assert lines[0] == f"preparing target {SMOLLM2}..."
    assert re.fullmatch(rf"preparing target {SMOLLM2}: done in \d+:\d\d \| {re.escape(str(path))}",
                        lines[-1])  # fmt: skip
    line = re.compile(rf"preparing target {SMOLLM2}: ([\d.]+)/100 % \((\d+)%\)(, ETA \d+:\d\d)?"
                      r", \d+:\d\d elapsed \| (.+)")  # fmt: skip
    parsed = [line.fullmatch(text) for text in lines[1:-1]]
    assert all(parsed), [t for t, m in zip(lines[1:-1], parsed, strict=True) if not m][:3]
    done = [float(m.group(1)) for m in parsed]
    assert done == sorted(done) and done[-1] == 100
    assert all(m.group(3) for m in parsed if 0 < float(m.group(1)) < 100)  # an ETA while under way
    steps = [m.group(4) for m in parsed]
    assert steps.count("de-quantising the tensors") > 200  # one line per tensor (272)
    assert set(steps) >= {"reading the tokenizer", "reading the weights", "writing safetensors"}
    captured = capfd.readouterr()
    for text in (captured.out, captured.err, log.read_text()):
        assert "it/s" not in text and "de-quantizing GGUF tensors" not in text  # no tqdm bar
