"""The README's quickstart is exactly two commands, CI runs the second one verbatim, and its links resolve."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _quickstart_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, re.S)
    return [b.strip() for b in blocks]


def test_quickstart_has_exactly_two_commands():
    cmds = _quickstart_commands()
    assert len(cmds) == 2
    assert all("\n" not in c for c in cmds)
    assert cmds[0].endswith("jobs/train_flux.py")
    assert "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci = (ROOT / ".ci" / "run").read_text()
    assert f'bash -c "{_quickstart_commands()[1]}"' in ci


def test_the_readme_links_the_reference_pages_and_every_link_resolves():
    readme = (ROOT / "README.md").read_text()
    pages = sorted((ROOT / "docs").glob("*.md"))
    assert pages and all(f"](docs/{p.name})" in readme for p in pages)
    for doc in [ROOT / "README.md", *pages]:
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", doc.read_text()):
            assert (doc.parent / target).exists(), f"{doc.name} links {target}, which does not exist"
