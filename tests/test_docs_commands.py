"""Every shell command of README.md runs as written, in order, from a directory laid
out like the repository root (relative paths included), at toy sizes appended
through `--set`; commands that need a cluster are named here, not run."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from jaxmoe.fake_devices import without_fake_devices

ROOT = Path(__file__).parent.parent
TOY_MODEL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
             "model.head_dim=16", "model.mlp_hidden=64", "moe.expert_hidden=32",
             "train.batch_size=8", "train.seq_len=32"]
# the default job's downstream task asks about lines longer than the toy rows (its own
# test trains the shipped config: tests/test_train.py)
TOY_RUN = ["train.steps=3", "optimizer.warmup_steps=1", "train.eval_every=0", "train.eval_batches=1",
           "train.evals.tasks=[]", "logging.progress=false"]
# appended to each command, by module: small enough to take seconds
TOY_ARGS = {
    "jaxmoe.train": [a for s in TOY_MODEL + TOY_RUN for a in ("--set", s)],
    "jaxmoe.launch": [a for s in TOY_MODEL + TOY_RUN for a in ("--set", s)],
    "jaxmoe.generate": ["--max-new-tokens", "8"],
    "jaxmoe.data.prepare": ["--no-progress"],
    "jaxmoe.export": [],
    "jaxmoe.eval": ["--limit", "4", "--max-length", "128"],  # the toy runs' rows are 32 long
    # the shipped batch and layer count; narrow layers, short sequences
    "jaxmoe.plan": [a for s in ["model.d_model=32", "model.num_heads=2", "model.num_kv_heads=1",
                                "model.head_dim=16", "model.mlp_hidden=64", "model.vocab_size=256",
                                "moe.expert_hidden=32", "train.seq_len=64", "train.loss_chunk=0"] for a in ("--set", s)],
}
# commands for a cluster or for the test suite itself
NOT_RUN = (r"^#SBATCH", r"^srun ", r"^export JAX_LOCAL_DEVICE_IDS", r"--config \.\.\. --coordinator",
           r"^pytest$")


def readme_commands() -> list[str]:
    """The lines of the README's bash blocks, `pip install ... &&` prefixes dropped
    (the package is installed already) and trailing comments removed."""
    text = (ROOT / "README.md").read_text()
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"^pip install [^&]*&& ", "", line.strip())
            if not line.startswith("#SBATCH"):
                line = re.sub(r"\s+#.*$", "", line)
            if line:
                lines.append(line)
    return lines


def _module(command: str) -> str:
    match = re.search(r"python -m (jaxmoe[.\w]+)", command)
    assert match, f"README command runs no jaxmoe module: {command}"
    return match.group(1)


def test_every_command_is_either_run_or_named_as_cluster_only():
    commands = readme_commands()
    skipped = [c for c in commands if any(re.search(p, c) for p in NOT_RUN)]
    assert len(skipped) == 8, skipped  # 2 sbatch scripts of 2 and 3 lines, 2 hosts, pytest
    for c in commands:
        if c not in skipped:
            assert _module(c) in TOY_ARGS, c


def _your_own_data(root: Path) -> None:
    """What "Your own data" assumes the user has: a tokenizer, a corpus, and the
    README's YAML block saved as my.yaml."""
    import json

    from tiny_tokenizer import make_tokenizer, sentences
    make_tokenizer(root / "tok")
    texts = sentences(600, seed=3)
    (root / "corpus").mkdir()
    for i in range(0, 300, 10):
        (root / "corpus" / f"{i}.txt").write_text(" ".join(texts[i:i + 10]))
    (root / "more.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[300:]))
    text = (ROOT / "README.md").read_text()
    section = text[text.index("### Your own data"):]
    (root / "my.yaml").write_text(re.search(r"```yaml\n(.*?)```", section, re.S).group(1))


@pytest.mark.slow
def test_readme_commands_run_as_written(tmp_path):
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    _your_own_data(tmp_path)
    # as a user's shell would be: one CPU device unless the command asks for more
    env = without_fake_devices(os.environ)
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    ran = []
    for command in readme_commands():
        if any(re.search(p, command) for p in NOT_RUN):
            continue
        words = shlex.split(command)
        run_env = dict(env)
        while re.match(r"^[A-Z_]+=", words[0]):  # leading VAR=value assignments
            key, value = words.pop(0).split("=", 1)
            # XLA_FLAGS keeps the suite's compile-speed flags (code generation only)
            run_env[key] = f"{run_env.get(key, '')} {value}".strip() if key == "XLA_FLAGS" else value
        words = [sys.executable if w == "python" else w for w in words]
        result = subprocess.run(words + TOY_ARGS[_module(command)], cwd=tmp_path, env=run_env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{command}\n{result.stderr[-3000:]}"
        ran.append(command)
        if "jaxmoe.generate" in command:
            prompt = re.search(r'--prompt "([^"]*)"', command).group(1)
            assert result.stdout.startswith(prompt), result.stdout  # the prompt, continued
    assert (tmp_path / "tiny.safetensors").stat().st_size > 0
    assert len(ran) == len(readme_commands()) - 8
