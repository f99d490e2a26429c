"""What a newcomer meets first: `specbus demo`'s input checks, `--version`, `specbus feed`
telling why it waits, the progress lines and the summary's TensorBoard hook."""

from __future__ import annotations

import io
import os
import re
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


def test_a_percentage_reads_as_one_and_an_overrun_budget_says_what_is_left():
    """Issue 34: "62/100 % (62%)", and the training bar at "178/180 s (99%), ETA 0:01" for the
    15 s the last step and its checkpoint took."""
    from specbus.ops.demo import budget_progress
    from specbus.ops.progress import phase

    out = io.StringIO()
    with phase("preparing target", 100, "%", stream=out, every_s=0) as p:
        p.update(62, info="reading")
    assert re.match(r"preparing target: 62%, ETA \d+:\d\d, \d+:\d\d elapsed \| reading$",
                    out.getvalue().splitlines()[1])  # fmt: skip

    assert budget_progress(100.0, 180.0, "step 9") == (100.0, "step 9")
    done, info = budget_progress(195.0, 180.0, "step 12")
    assert done == 180.0 and info.startswith("time budget used: finishing the last step")
    out = io.StringIO()
    with phase("training", 180, "s", stream=out, every_s=0) as p:
        p.update(done, info=info)
    line = out.getvalue().splitlines()[1]
    assert line.startswith("training: 180/180 s (100%), ") and "ETA" not in line, line


def test_the_trainer_says_what_it_waits_for_in_each_mode():
    """Issue 34: every trainer said it waited for `specbus produce` / `specbus feed`, a
    recording's trainer and `demo --live`'s included, where neither runs."""
    from specbus.core.config import build_config
    from specbus.ops.commands import training_source

    url = "nats://127.0.0.1:4222"
    plain = build_config({}, [])
    assert "from `specbus produce`, tasks from `specbus feed`" in training_source(plain, None, url)
    live = build_config({"deployment": {"mode": "live"}}, [])
    said = training_source(live, None, url)
    assert "captured traffic" in said and "specbus intake" in said
    assert "specbus produce" not in said and "specbus feed" not in said
    said = training_source(plain, "/data/rec1", None)
    assert "recording /data/rec1 (a directory: no broker needed)" in said and "nats" not in said
    assert f"recording run 'rec1' on {url}" in training_source(plain, "rec1", url)


def test_the_holdout_is_apart_from_the_limit_and_the_feed_line_says_so():
    """Issue 34: examples/short-run.yaml fed 200 of 200 tasks with `holdout: 50`, and nothing
    said whether the hold-out came out of `limit`. It does not: the hold-out is the dataset's
    last records, the limit counts what is trained, and the two never overlap."""
    from specbus.core.config import build_config
    from specbus.core.data.datasets import split_holdout
    from specbus.ops.commands import what_is_fed

    records = [{"i": i} for i in range(300)]
    train, held = split_holdout(records, 50, 200)
    assert train == records[:200] and held == records[250:]
    cfg = build_config({"data": {"source": "gsm8k", "limit": 200, "holdout": 50}}, [])
    assert what_is_fed(cfg.data) == (
        "the first 200 records of gsm8k (data.holdout: the dataset's last 50 records are held "
        "back for evaluation, apart from data.limit)"
    )


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

    # `demo --live` ends with the same block (issue 34: it ended with none), saying it trained
    # from served traffic and what the users saw
    from specbus.ops.traffic import TrafficReport

    live = build_config({"run": "s", "run_dir": str(tmp_path), "deployment": {"mode": "live"}}, [])
    traffic = TrafficReport(sent=40, ok=40, completion_tokens=2560, wall_s=60.0)
    text = summary(live, args, Comparison(report(1.0), report(1.25), 3), tmp_path / "export",
                   {"target": 3, "training": 200, "evaluation": 30, "total": 233},
                   url_was_embedded=True, traffic=traffic)  # fmt: skip
    assert "== specbus demo --live: done in 3.9 min" in text
    assert "from served traffic" in text and "producer" not in text
    assert "users     40 sent, 40 ok, errors: none" in text
    assert "untrained 1.000 -> trained 1.250" in text and "specbus demo --live --minutes 10" in text


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
    line = re.compile(rf"preparing target {SMOLLM2}: (\d+)%(, ETA \d+:\d\d)?"
                      r", \d+:\d\d elapsed \| (.+)")  # fmt: skip
    parsed = [line.fullmatch(text) for text in lines[1:-1]]
    assert all(parsed), [t for t, m in zip(lines[1:-1], parsed, strict=True) if not m][:3]
    done = [float(m.group(1)) for m in parsed]
    assert done == sorted(done) and done[-1] == 100
    assert all(m.group(2) for m in parsed if 0 < float(m.group(1)) < 100)  # an ETA while under way
    steps = [m.group(3) for m in parsed]
    assert steps.count("de-quantising the tensors") > 200  # one line per tensor (272)
    assert set(steps) >= {"reading the tokenizer", "reading the weights", "writing safetensors"}
    captured = capfd.readouterr()
    for text in (captured.out, captured.err, log.read_text()):
        assert "it/s" not in text and "de-quantizing GGUF tensors" not in text  # no tqdm bar
