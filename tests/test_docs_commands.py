"""Every shell command and Python block of README.md and the docs' pages runs as written.

README.md runs first, in a directory laid out like the repository root; each docs page
then runs in a directory of its own holding what its reader is assumed to have: the
configs, the default job's run (README's), a tokenizer and a corpus. A page's bash
lines run in order, at toy sizes appended through `--set`; then its Python blocks, one
after another in one process. A command that already ran as written (on another page)
is not run again. Commands that need a GPU, a cluster or an install are named here, not
run."""

import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from jaxmoe.runtime.fake_devices import without_fake_devices

ROOT = Path(__file__).parent.parent
# (each config's own layer count: a pipeline's stages need their layers)
# heads of 32: every projection a multiple of 32 wide, as MXFP8 projections need
TOY_MODEL = ["model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
             "model.head_dim=32", "model.mlp_hidden=64", "moe.expert_hidden=32",
             "train.batch_size=16", "train.seq_len=32"]  # 16: cpu8_pipeline's 4 x 4 micro-batches
# the default job's downstream task asks about lines longer than the toy rows (its own
# test trains the shipped config: tests/test_train.py)
TOY_RUN = ["train.steps=3", "optimizer.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1",
           "train.evals.tasks=[]", "logging.progress=false", "train.accumulation_steps=1"]
# appended to each command, by module: small enough to take seconds
TOY_ARGS = {
    "jaxmoe.train": [a for s in TOY_MODEL + TOY_RUN for a in ("--set", s)],
    "jaxmoe.launch": [a for s in TOY_MODEL + TOY_RUN for a in ("--set", s)],
    "jaxmoe.generate": ["--max-new-tokens", "8"],
    "jaxmoe.data.prepare": ["--no-progress"],
    "jaxmoe.export": [],
    "jaxmoe.observe.plots": [],
    "jaxmoe.eval": ["--limit", "4", "--max-length", "128"],  # the toy runs' rows are 32 long
    # the shipped batch and layer count; narrow layers, short sequences; a search compiles
    # for 30 s, not the page's 600
    "jaxmoe.plan": [a for s in ["model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
                                "model.head_dim=32", "model.mlp_hidden=64", "model.vocab_size=256",
                                "moe.expert_hidden=32", "train.seq_len=64", "train.loss_chunk=0"]
                    for a in ("--set", s)] + ["--budget-s", "30"],
}
# commands for a cluster, a GPU, an install or the test suite itself
NOT_RUN = (r"^#SBATCH", r"^srun ", r"^export JAX_LOCAL_DEVICE_IDS", r"--config \.\.\. --coordinator",
           r"^pytest$", r"^pip install ", r"^bash benchmarks/gpu\.sh")
NOT_RUN_COUNT = 11  # 2 sbatch scripts of 2 and 3 lines, 2 hosts, pytest, 1 install, gpu.sh, ...


def pages() -> list[Path]:
    """README.md, then the docs' Markdown pages in the order of docs/index.md's tables of
    contents (the generated reference pages hold no commands)."""
    index = (ROOT / "docs" / "index.md").read_text()
    entries = [e for block in re.findall(r"```\{toctree\}\n(.*?)```", index, re.S)
               for e in block.splitlines() if e and not e.startswith(":")]
    found = [ROOT / "docs" / f"{e}.md" for e in entries if (ROOT / "docs" / f"{e}.md").is_file()]
    return [ROOT / "README.md", *found]


def blocks(page: Path, language: str) -> list[str]:
    """A page's fenced blocks of a language, those indented in a list item included."""
    found = re.findall(rf"^([ \t]*)```{language}\n(.*?)^\1```", page.read_text(), re.S | re.M)
    return [textwrap.dedent(body) for _, body in found]


def commands(page: Path) -> list[str]:
    """The lines of a page's bash blocks, `pip install ... &&` prefixes dropped (the
    package is installed already) and trailing comments removed."""
    lines = []
    for block in blocks(page, "bash"):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"^pip install [^&]*&& ", "", line.strip())
            if not line.startswith("#SBATCH"):
                line = re.sub(r"\s+#.*$", "", line)
            if line:
                lines.append(" ".join(line.split()))  # a continued line's indent is one space
    return lines


def _module(command: str) -> str | None:
    match = re.search(r"python -m (jaxmoe[.\w]+)", command)
    return match.group(1) if match else None


def _not_run(command: str) -> bool:
    return any(re.search(p, command) for p in NOT_RUN)


def test_every_command_is_either_run_or_named_as_not_run():
    every = [c for page in pages() for c in commands(page)]
    skipped = [c for c in every if _not_run(c)]
    assert len(skipped) == NOT_RUN_COUNT, skipped
    for c in every:
        if not _not_run(c):
            assert _module(c) in TOY_ARGS or c.startswith("python -c "), c


def test_the_pages_are_found():
    names = [p.name for p in pages()]
    assert names[0] == "README.md" and "first-gpu-run.md" in names and "jax-api.md" in names
    assert sum(len(blocks(p, "python")) for p in pages()) >= 8


def _devices_needed(words: list[str], directory: Path) -> int:
    """The fake CPU devices a train command's config asks for (1 if it leaves the count
    to the devices there are)."""
    from jaxmoe.config import load_config
    if "--config" not in words:
        return 1
    sets = [words[i + 1] for i, w in enumerate(words) if w == "--set"]
    mesh = load_config(directory / words[words.index("--config") + 1], sets).mesh
    return max(1, mesh.stage * mesh.context * mesh.expert * max(mesh.data, 1))


def _reader_has(directory: Path, readme_run: Path | None) -> None:
    """What the pages assume their reader has: the configs, a tokenizer and a corpus,
    `my.yaml` as "Your own data" writes it, and the default job's run."""
    import json

    from tiny_tokenizer import make_tokenizer, sentences
    directory.mkdir(exist_ok=True)
    (directory / "configs").symlink_to(ROOT / "configs")
    make_tokenizer(directory / "tok")
    texts = sentences(600, seed=3)
    (directory / "corpus").mkdir()
    for i in range(0, 300, 10):
        (directory / "corpus" / f"{i}.txt").write_text(" ".join(texts[i:i + 10]))
    (directory / "more.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[300:]))
    own_data = (ROOT / "docs" / "guides" / "own-data.md").read_text()
    (directory / "my.yaml").write_text(re.search(r"```yaml\n(.*?)```", own_data, re.S).group(1))
    if readme_run is not None:
        shutil.copytree(readme_run, directory / "runs" / "tiny")


def _run_page(page: Path, directory: Path, env: dict, ran: set[str]) -> None:
    for command in commands(page):
        if _not_run(command) or command in ran:
            continue
        words = shlex.split(command)
        run_env = dict(env)
        while re.match(r"^[A-Z_]+=", words[0]):  # leading VAR=value assignments
            key, value = words.pop(0).split("=", 1)
            # XLA_FLAGS keeps the suite's compile-speed flags (code generation only)
            run_env[key] = f"{run_env.get(key, '')} {value}".strip() if key == "XLA_FLAGS" else value
        module = _module(command)
        if module == "jaxmoe.train" and "device_count" not in run_env.get("XLA_FLAGS", ""):
            devices = _devices_needed(words, directory)  # a GPU node's command, on as many CPU devices
            if devices > 1:
                run_env["XLA_FLAGS"] = (f"{run_env.get('XLA_FLAGS', '')} "
                                        f"--xla_force_host_platform_device_count={devices}").strip()
        words = [sys.executable if w == "python" else w for w in words]
        result = subprocess.run(words + TOY_ARGS.get(module, []), cwd=directory, env=run_env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{page.name}: {command}\n{result.stderr[-3000:]}"
        ran.add(command)
        if module == "jaxmoe.generate":
            prompt = re.search(r'--prompt "([^"]*)"', command).group(1)
            assert result.stdout.startswith(prompt), result.stdout  # the prompt, continued
    python = blocks(page, "python")
    if python:
        script = directory / f"{page.stem}_blocks.py"
        script.write_text("\n".join(python))
        result = subprocess.run([sys.executable, script.name], cwd=directory, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{page.name}'s Python blocks\n{result.stderr[-3000:]}"


@pytest.mark.slow
def test_docs_commands_and_python_blocks_run_as_written(tmp_path):
    # as a user's shell would be: one CPU device unless the command asks for more
    env = without_fake_devices(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    ran: set[str] = set()
    readme, *docs = pages()
    _reader_has(tmp_path / "README", None)
    _run_page(readme, tmp_path / "README", env, ran)
    assert (tmp_path / "README" / "runs" / "tiny" / "metrics.jsonl").stat().st_size > 0
    for page in docs:
        directory = tmp_path / page.stem
        _reader_has(directory, tmp_path / "README" / "runs" / "tiny")
        _run_page(page, directory, env, ran)
    every = {c for page in pages() for c in commands(page) if not _not_run(c)}
    assert ran == every, every - ran
    assert (tmp_path / "checkpoints" / "tiny.safetensors").stat().st_size > 0
    assert (tmp_path / "huggingface" / "tiny_hf" / "config.json").is_file()
