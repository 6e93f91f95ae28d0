"""``exitlm --help``, every sub-command's help and argument errors import no torch (nor
numpy): they answer at once instead of after torch's start-up (issue 32). The test checks
the imports, not the time."""

from __future__ import annotations

import json
import subprocess
import sys

from _robust_util import ROOT

HEAVY = ("torch", "numpy")

_PROBE = r"""
import json, sys
import exitlm.cli

cases = json.loads(sys.argv[1])
parser = exitlm.cli.build_parser()
commands = sorted(exitlm.cli.subparsers(parser))
plan = exitlm.cli.subparsers(exitlm.cli.subparsers(parser)["plan"])
cases += [[c, "--help"] for c in commands] + [["plan", p, "--help"] for p in sorted(plan)]
out = []
for argv in cases:
    try:
        rc = exitlm.cli.main(argv)
    except SystemExit as stop:
        rc = stop.code
    out.append([argv, rc, [m for m in json.loads(sys.argv[2]) if m in sys.modules]])
print("RESULT " + json.dumps({"commands": commands, "runs": out}))
"""


def test_help_and_argument_errors_import_no_torch() -> None:
    cases = [
        ["--help"],
        [],  # no command: the overview
        ["generate", "hi", "--strategy", "nope"],  # argparse choice error
        ["generate", "hi", "--max-new-tokens", "x"],
        ["train", "--config", "tiny", "--bogus"],
        ["serve", "--port", "-5"],
        ["serve", "--port", "99999"],  # would wrap around to port 34463
        ["bench", "--threads", "0"],
        ["nope"],
    ]
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(cases), json.dumps(HEAVY)],
                          capture_output=True, text=True, env=env, timeout=300, check=False)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line is not None, proc.stderr[-3000:]
    got = json.loads(line[len("RESULT "):])
    assert {"generate", "train", "serve", "bench", "plan", "convert"} <= set(got["commands"])
    for argv, rc, heavy in got["runs"]:
        assert heavy == [], f"exitlm {' '.join(argv)} imported {heavy}"
        expected = 0 if argv and argv[-1] == "--help" else 2
        assert rc == expected, (argv, rc, proc.stderr[-2000:])
    assert len(got["runs"]) > len(cases) + 8  # every sub-command's help ran
    assert "exitlm generate: error:" in proc.stderr  # argument errors are still reported
    assert "--port: expected an integer in [0, 65535], got 99999" in proc.stderr
