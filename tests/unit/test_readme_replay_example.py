"""The README's worked replay example ("Trying a policy before it ships") is
what `brownout replay` prints for it: the docs cannot drift from the tool."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from proxy.cli import main

ROOT = Path(__file__).resolve().parents[2]


def readme_example() -> tuple[str, list[str], str]:
    """(the candidate policy, the command's arguments, its printed report)."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Trying a policy before it ships", 1)[1].split("\n## ", 1)[0]
    policy = re.search(r"```yaml\n# no-rescue\.yaml\n(.*?)```", section, re.S)
    run = re.search(r"```text\n\$ (brownout replay .*?)\n(trace .*?)```", section, re.S)
    assert policy and run, "the worked example is missing from the README"
    command = run.group(1).replace("\\\n", " ")
    report = run.group(2)
    return policy.group(1), command.split()[1:], report


def test_the_readme_worked_example_is_what_replay_prints(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    policy, argv, expected = readme_example()
    (tmp_path / "no-rescue.yaml").write_text(policy)
    (tmp_path / "recording-drill-1.jsonl.gz").symlink_to(
        ROOT / "tests" / "fixtures" / "recordings" / "recording-drill-1.jsonl.gz"
    )
    monkeypatch.chdir(tmp_path)
    rc = main(argv)
    out, err = capsys.readouterr()
    printed = out + err
    # The README marks the exit status on the last line: "(exit 1)".
    status = re.search(r"\(exit (\d+)\)\s*$", expected)
    assert status is not None
    assert rc == int(status.group(1))
    want = [re.sub(r"\s+\(exit \d+\)\s*$", "", line).rstrip() for line in expected.splitlines()]
    got = [line.rstrip() for line in printed.splitlines()]
    assert sorted(filter(None, got)) == sorted(filter(None, want)), "\n".join(got)
