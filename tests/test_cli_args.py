"""`specbus` argument parsing: dotted overrides anywhere after the command."""

from __future__ import annotations

import pytest
from specbus.ops.cli import build_parser, parse


def test_overrides_after_an_option_are_kept_in_order():
    """The README's offline command: `train --config C run=w1a --from-recording R data.epochs=3`
    (argparse alone refuses the second run of positionals)."""
    args = parse(build_parser(), ["train", "--config", "c.yaml", "run=w1a", "--from-recording",
                                  "/data/rec1", "data.epochs=3"])  # fmt: skip
    assert args.from_recording == "/data/rec1"
    assert args.overrides == ["run=w1a", "data.epochs=3"]


def test_an_unknown_option_is_still_refused(capsys):
    with pytest.raises(SystemExit) as e:
        parse(build_parser(), ["train", "--config", "c.yaml", "--no-such-option", "run=a"])
    assert e.value.code == 2 and "--no-such-option" in capsys.readouterr().err
