"""The documentation: the site builds with warnings as errors, the generated pages are
what docs/generate.py writes from the code today, and the README is a front page whose
links lead somewhere. (Its commands and Python blocks run in test_docs_commands.py.)"""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
sys.path.insert(0, str(ROOT / "docs"))

import generate  # noqa: E402  (docs/generate.py)


def test_generated_pages_are_fresh():
    stale = [str(p.relative_to(ROOT)) for p, text in generate.pages().items()
             if p.read_text() != text]
    assert not stale, f"run `python docs/generate.py`: {stale} differ from what it writes"


def test_a_stale_page_is_named(tmp_path, monkeypatch, capsys):
    """--check names a page that differs, and one whose source changed since."""
    page = ROOT / "docs" / "reference" / "config.md"
    text = page.read_text()
    assert "| `top_k` | int | `2` |" in text  # the default, read from jaxmoe/config/sections.py
    monkeypatch.setattr(generate, "config_reference", lambda: text.replace("`2`", "`3`"))
    assert generate.main(["--check"]) == 1
    assert "docs/reference/config.md differs" in capsys.readouterr().err
    # figures compiled from a config whose values have changed since are refused
    rows = [json.loads(line) for line in generate.PROGRAMS_FILE.read_text().splitlines()]
    rows[0] = rows[0] | {"config_digest": "0" * 64}
    changed = tmp_path / "programs.jsonl"
    changed.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setattr(generate, "PROGRAMS_FILE", changed)
    with pytest.raises(SystemExit, match=rf"changed since: \['{rows[0]['program']}'\]"):
        generate.performance_page()


def test_every_config_key_says_what_it_means():
    """Every key of every section (nested ones too) has a row with a meaning; a key
    without a comment stops the generator, naming it."""
    import dataclasses

    from jaxmoe.config import Config

    def keys(cls):
        for f in dataclasses.fields(cls):
            value = f.default_factory() if f.default is dataclasses.MISSING else f.default
            yield f.name
            if dataclasses.is_dataclass(value):
                yield from keys(type(value))

    text = generate.config_reference()
    rows = re.findall(r"^\| `(\w+)` \| [^|]*\| [^|]*\| (.+) \|$", text, re.M)
    expected = [k for f in dataclasses.fields(Config) for k in keys(type(getattr(Config(), f.name)))]
    assert sorted(name for name, _ in rows) == sorted(expected)
    assert all(meaning.strip() for _, meaning in rows)
    assert len(expected) > 110


def test_every_command_is_in_the_reference():
    text = (ROOT / "docs" / "reference" / "commands.md").read_text()
    for module in generate.COMMANDS:
        parser = __import__(module, fromlist=["build_parser"]).build_parser()
        assert f"## `{parser.prog}`" in text
        for action in parser._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in text, (parser.prog, option)


def test_the_site_builds_with_warnings_as_errors(tmp_path):
    result = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-E",
                             "-c", "docs", ".", str(tmp_path)], cwd=ROOT,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-5000:]
    for page in ("index.html", "docs/index.html", "docs/guides/first-gpu-run.html",
                 "docs/reference/config.html", "docs/reference/api.html",
                 "docs/performance.html", "notebooks/quickstart.html"):
        assert (tmp_path / page).stat().st_size > 0, page
    api = (tmp_path / "docs" / "reference" / "api.html").read_text()
    assert "jaxmoe.apply" in api and "fp32 logits" in api  # from apply's docstring


def test_a_broken_link_fails_the_build(tmp_path):
    """The same build fails on a page linking to one that does not exist."""
    import shutil
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "docs", copy / "docs", ignore=shutil.ignore_patterns("_build"))
    shutil.copytree(ROOT / "notebooks", copy / "notebooks")
    page = copy / "docs" / "guides" / "mxfp8.md"
    page.write_text(page.read_text() + "\nSee [nowhere](nowhere.md).\n")
    result = subprocess.run([sys.executable, "-m", "sphinx", "-W", "-q", "-E", "-c", "docs", ".",
                             str(tmp_path / "out")], cwd=copy, capture_output=True, text=True,
                            timeout=600, env={"PYTHONPATH": str(ROOT), **__import__("os").environ})
    assert result.returncode != 0 and "nowhere" in result.stderr, result.stderr[-2000:]


def test_readme_is_a_front_page():
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, len(lines)
    # the two commands come first
    assert lines[3:5] == ['pip install -e ".[eval]" && python -m jaxmoe.train --config configs/tiny.yaml',
                          'pip install -e ".[test]" && pytest']
    # every relative link leads to a file, and each of the five tasks is linked
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    for link in links:
        if not link.startswith("http"):
            assert (ROOT / link).exists(), link
    for page in ("docs/guides/quickstart.md", "docs/guides/own-data.md",
                 "docs/guides/first-gpu-run.md", "docs/guides/jax-api.md",
                 "docs/guides/huggingface.md"):
        assert page in links, page
    # measurement history stays in benchmarks/RESULTS.md
    assert not re.search(r"20\d\d-\d\d-\d\d", text)


def test_docs_pages_link_to_files_that_exist():
    """Relative links between the Markdown pages, as GitHub follows them."""
    for page in (ROOT / "docs").rglob("*.md"):
        if "_build" in page.parts:
            continue
        for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / link).resolve().exists(), (page, link)
