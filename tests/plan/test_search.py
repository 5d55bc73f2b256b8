"""The layout search (`jaxmoe.plan.search`): the candidates a config accepts, pruning by
static memory, the time budget, ranking by expected step among layouts that fit, and
the search against a brute-force loop over the same candidates, compiled for 8
virtual B300s."""

import pytest

from jaxmoe.config import config_from_dict
from jaxmoe.model.remat import REMAT_POLICIES
from jaxmoe.plan import search as S
from jaxmoe.plan.targets import gpu_compiler_available

RAW = {"model": {"d_model": 64, "num_layers": 4, "num_heads": 4, "num_kv_heads": 2,
                 "num_dense_layers": 0, "mlp_hidden": 128, "compute_dtype": "bfloat16"},
       "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 64},
       "train": {"batch_size": 16, "seq_len": 64}}
ONE_PIPE = {"remats": ("full",), "dispatchers": ("alltoall",), "stage_microbatches": (2,),
            "virtual_stages": (1,), "schedules": ("circular",)}


def test_candidates_are_every_layout_the_config_accepts():
    """8 devices over 4 axes: 20 ordered factorisations; 8 stages of 4 layers and a
    context of 8 over 4 heads are refused by the config's checks, the other 18 kept
    (without an expert axis, the config's own dispatcher)."""
    cfg = config_from_dict(RAW)
    found, refused = S.candidates(cfg, 8, **ONE_PIPE)
    assert len(found) == 18 and refused == {"mesh.stage": 1, "mesh.context": 1}
    assert {c.dispatcher for c, _ in found if c.expert == 1} == {cfg.moe.dispatcher}
    # restricted to two axes: data x expert, 4 ways
    two, _ = S.candidates(cfg, 8, axes=("data", "expert"), **ONE_PIPE)
    assert sorted((c.data, c.expert) for c, _ in two) == [(1, 8), (2, 4), (4, 2), (8, 1)]
    # each candidate's config is the layout it names
    c, config = two[0]
    assert (config.mesh.data, config.mesh.expert, config.train.remat) == (c.data, c.expert,
                                                                          c.remat)


def test_a_held_micro_batch_sets_each_layouts_slices():
    """micro_batch=1 on 16 sequences and 8 devices: every layout runs one sequence per
    GPU per pass, its accumulation slices making up the rest (data 8: 2 slices; stage 2
    with 2 micro-batches over 4 devices a stage: 2 slices); where no whole number of
    slices gives the pass (3 sequences of 16), the layout is refused. Companion:
    without it the config's one slice stays, and the sequences per pass follow the
    layout."""
    from jaxmoe.plan.anchors import micro_batch
    cfg = config_from_dict(RAW)
    held, _ = S.candidates(cfg, 8, axes=("data", "stage", "expert"), micro_batch=1, **ONE_PIPE)
    assert held and {micro_batch(config) for _, config in held} == {1}
    slices = {(c.data, c.stage, c.expert): c.accumulation_steps for c, _ in held}
    assert slices[(8, 1, 1)] == 2 and slices[(2, 2, 2)] == 2 and slices[(1, 1, 8)] == 2
    free, _ = S.candidates(cfg, 8, axes=("data", "stage", "expert"), **ONE_PIPE)
    assert {c.accumulation_steps for c, _ in free} == {1}
    assert {micro_batch(config) for _, config in free} == {2.0, 4.0}
    # three sequences a pass do not divide 16: every layout refused
    none, refused = S.candidates(cfg, 8, axes=("data", "expert"), micro_batch=3, **ONE_PIPE)
    assert none == [] and refused["train.accumulation_steps"] == 4


def test_only_narrows_each_choice():
    """`only` keeps the mesh sizes given and replaces the remat, dispatcher and pipeline
    lists (a policy outside the defaults included); a name that is no choice is
    refused. Companion: without it every factorisation and every remat policy."""
    cfg = config_from_dict(RAW)
    only = {"expert": (2, 4), "remat": ("save_attention",), "dispatcher": ("ragged",)}
    found, _ = S.candidates(cfg, 8, axes=("data", "expert"), only=only)
    assert sorted((c.data, c.expert) for c, _ in found) == [(2, 4), (4, 2)]
    assert {(c.remat, c.dispatcher) for c, _ in found} == {("save_attention", "ragged")}
    assert {config.train.remat for _, config in found} == {"save_attention"}
    every, _ = S.candidates(cfg, 8, axes=("data", "expert"))
    assert {c.expert for c, _ in every} == {1, 2, 4, 8}
    assert {c.remat for c, _ in every} == set(S.REMATS) == {"none", *REMAT_POLICIES}
    # the pipeline's lists where there are stages (stage 1 runs one micro-batch)
    piped, _ = S.candidates(cfg, 8, axes=("data", "stage"), only={
        "stage": (2,), "stage_microbatches": (4,), "virtual_stages": (2,),
        "remat": ("full", "save_attention")})
    assert sorted((c.data, c.stage, c.stage_microbatches, c.virtual_stages, c.schedule,
                   c.remat) for c, _ in piped) == [
        (4, 2, 4, 2, "1f1b", "full"), (4, 2, 4, 2, "circular", "full"),
        (4, 2, 4, 2, "circular", "save_attention")]  # 1F1B recomputes every chunk
    assert {config.pipeline.schedule for c, config in piped} == {"circular", "1f1b"}
    with pytest.raises(ValueError, match="not layout choices"):
        S.candidates(cfg, 8, only={"experts": (8,)})


@pytest.mark.parametrize("only, why", [
    ("stage=2", "stage is not among --axes"),
    ("expert=,", "no values"),
    ("expert=two", "positive whole numbers"),
    ("experts=8", "expected CHOICE=V1,V2"),
])
def test_the_planner_refuses_choices_it_cannot_search(tmp_path, capsys, only, why):
    """--only naming a mesh axis the search does not lay out, no values, a size that is
    not a number, or no choice at all: exit 2 with one line, nothing compiled.
    Companion: a valid --only reaches the search, which says when no layout takes it
    (sizes that do not divide the devices)."""
    import yaml

    from jaxmoe.plan.planner import main
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(RAW))
    args = ["--config", str(path), "--target", "b300", "--search", "--devices", "8",
            "--axes", "data,expert"]
    assert main(args + ["--only", only]) == 2
    assert why in capsys.readouterr().err
    assert main(args + ["--only", "expert=3"]) == 1
    assert "no layout takes these choices" in capsys.readouterr().out


def test_static_bytes_by_hand():
    """The bf16 working copy and gradient (4 bytes) per parameter on its device; the fp32
    master weights and Adam's moments (12) over the replicas that share it under ZeRO-1,
    whole without it; under fsdp all 16 over data; an MTP module's experts split as the
    layers' are. The search's compiles check that it stays below each compiled peak
    (test_the_search_finds_what_brute_force_finds)."""
    from jaxmoe.plan.counts import param_counts
    cfg = config_from_dict({**RAW, "mesh": {"data": 2, "expert": 4}})
    experts = 4 * 8 * 3 * 64 * 64
    dense = param_counts(cfg).total - experts
    assert S.static_bytes(cfg) == pytest.approx(dense * (4 + 12 / 8) + experts / 4 * (4 + 12 / 2))
    whole = config_from_dict({**RAW, "mesh": {"data": 2, "expert": 4, "zero1": False}})
    assert S.static_bytes(whole) == pytest.approx(dense * 16 + experts / 4 * 16)
    fsdp = config_from_dict({**RAW, "mesh": {"data": 2, "expert": 4, "parallelism": "fsdp"}})
    assert S.static_bytes(fsdp) == pytest.approx(dense * 16 / 2 + experts / 4 * 16 / 2)
    # an MTP module's routed experts are split over the expert axis as the layers' are
    mtp = config_from_dict({**RAW, "model": {**RAW["model"], "mtp_layers": 1},
                            "mesh": {"data": 2, "expert": 4}})
    added = param_counts(mtp).total - param_counts(cfg).total
    module_experts = 8 * 3 * 64 * 64
    assert S.static_bytes(mtp) - S.static_bytes(cfg) == pytest.approx(
        (added - module_experts) * (4 + 12 / 8) + module_experts / 4 * (4 + 12 / 2))


def _fake_evaluate(figures):
    def evaluate(cfg, target):
        return figures[(cfg.mesh.data, cfg.mesh.expert)]
    return evaluate


def test_ranked_by_expected_step_among_those_that_fit():
    """The fastest layout that does not fit ranks after every one that does; rows past
    the budget are marked, not ranked; a memory below every layout's static bytes
    prunes all of them (no compile). Companion: with room for it, the fastest wins."""
    cfg = config_from_dict(RAW)
    figures = {(1, 8): {"peak": 9e9, "expected": 1.0, "bound": 0.5},  # fastest, too big
               (2, 4): {"peak": 1e9, "expected": 2.0, "bound": 1.0},
               (4, 2): {"peak": 1e9, "expected": 3.0, "bound": 1.5},
               (8, 1): {"peak": 1e9, "expected": 4.0, "bound": 2.0}}
    choices = {"axes": ("data", "expert"), **ONE_PIPE}
    rows, _ = S.search(cfg, 8, "b300", evaluate=_fake_evaluate(figures), memory=5e9, **choices)
    order = [(r.candidate.data, r.candidate.expert) for r in rows]
    assert order == [(2, 4), (4, 2), (8, 1), (1, 8)] and not rows[-1].fits
    rows, _ = S.search(cfg, 8, "b300", evaluate=_fake_evaluate(figures), memory=10e9, **choices)
    assert (rows[0].candidate.data, rows[0].candidate.expert) == (1, 8)
    rows, _ = S.search(cfg, 8, "b300", budget_s=-1, evaluate=_fake_evaluate(figures),
                       **choices)
    assert all(r.why_not == "not compiled: past the time budget" for r in rows)
    rows, _ = S.search(cfg, 8, "b300", evaluate=None, memory=1.0, **choices)
    assert all(r.why_not.startswith("pruned") for r in rows)


def test_the_table_names_what_xla_recomputes_to_fit(capsys):
    """A layout whose program fits only because XLA rematerialised kernels says so in
    its row, with the seconds of its expected step they take; the others say nothing."""
    cfg = config_from_dict(RAW)
    figures = {(1, 8): {"peak": 4.9e9, "expected": 1.5, "bound": 0.7, "xla_recomputed": 0.42},
               (2, 4): {"peak": 1e9, "expected": 2.0, "bound": 1.0, "xla_recomputed": 0.0},
               (4, 2): {"peak": 1e9, "expected": 3.0, "bound": 1.5},
               (8, 1): {"peak": 1e9, "expected": 4.0, "bound": 2.0}}
    rows, refused = S.search(cfg, 8, "b300", evaluate=_fake_evaluate(figures), memory=5e9,
                             axes=("data", "expert"), **ONE_PIPE)
    S.print_search(rows, refused)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    marked = [line for line in lines if "XLA recomputes" in line]
    assert marked == [line for line in lines if "| yes, XLA recomputes 0.42 s to fit |" in line]
    assert len(marked) == 1 and "1.500 s" in marked[0]


def test_importing_the_search_leaves_jax_unstarted():
    """The planner imports the search before it sets JAX_PLATFORMS for a deviceless
    GPU compile: JAX imported by then reads the platform too early and offers no CUDA
    topology. Checked in a fresh interpreter."""
    import subprocess
    import sys
    code = "import sys, jaxmoe.plan.search; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_layouts_full_recomputation_compiles_first():
    """With every remat policy a candidate, each layout's `full` is compiled before any
    other policy of any layout, so that a budget that stops early has still compiled
    every layout once; the rest follow."""
    cfg = config_from_dict(RAW)
    compiled = []

    def evaluate(config, target):
        compiled.append((config.mesh.expert, config.train.remat))
        return {"peak": 1e9, "expected": 1.0, "bound": 0.5}

    S.search(cfg, 8, "b300", evaluate=evaluate, memory=5e9, axes=("data", "expert"),
             dispatchers=("alltoall",), stage_microbatches=(2,), virtual_stages=(1,))
    layouts = {expert for expert, _ in compiled}
    assert len(layouts) == 4 and len(compiled) == 4 * (1 + len(REMAT_POLICIES))
    assert {remat for _, remat in compiled[:4]} == {"full"}
    assert "full" not in {remat for _, remat in compiled[4:]}


def test_a_layout_the_compiler_fails_on_is_marked_and_the_rest_ranked():
    """XLA failing on one candidate (as it does on some offloading pipelines) marks
    that row and ranks the others, rather than ending the search."""
    import jax
    cfg = config_from_dict(RAW)

    def evaluate(config, target):
        if config.mesh.expert == 8:
            raise jax.errors.JaxRuntimeError("INTERNAL: during context [end-of-post-layout]")
        return {"peak": 1e9, "expected": float(config.mesh.data), "bound": 0.5}

    rows, _ = S.search(cfg, 8, "b300", evaluate=evaluate, memory=5e9, axes=("data", "expert"),
                       **ONE_PIPE)
    failed = [r for r in rows if r.why_not]
    assert [(r.candidate.data, r.candidate.expert) for r in failed] == [(1, 8)]
    assert failed[0].why_not.startswith("the compiler failed: INTERNAL")
    assert (rows[0].candidate.data, rows[0].candidate.expert) == (2, 4) and rows[0].fits


@pytest.mark.slow
@pytest.mark.skipif(not gpu_compiler_available(), reason="needs the gpu-compile extra")
def test_the_search_finds_what_brute_force_finds(capsys):
    """data x expert on 8 virtual B300s, each compiled once: the search's winner is
    the layout with the least expected step among those whose peak fits, found by a
    loop over every candidate, and no layout's static bytes exceed its compiled peak;
    the planner prints its overrides."""
    cfg = config_from_dict(RAW)
    seen = {}

    def evaluate(config, target):
        seen[(config.mesh.data, config.mesh.expert)] = S.evaluate(config, target)
        return seen[(config.mesh.data, config.mesh.expert)]

    choices = {"axes": ("data", "expert"), **ONE_PIPE}
    rows, refused = S.search(cfg, 8, "b300", evaluate=evaluate, **choices)
    found, _ = S.candidates(cfg, 8, **choices)
    assert len(seen) == len(found) == 4
    brute = min((c for c, _ in found), key=lambda c: seen[(c.data, c.expert)]["expected"])
    assert rows[0].candidate == brute and rows[0].fits
    # the expected steps differ between layouts (the search has something to rank)
    steps = sorted(f["expected"] for f in seen.values())
    assert steps[0] < steps[-1] and all(f["expected"] > f["bound"] for f in seen.values())
    # the pruning bound never exceeds what a layout compiled to hold
    assert all(r.static_bytes <= r.peak_bytes for r in rows)
    S.print_search(rows, refused)
    out = capsys.readouterr().out
    assert "best: " + " ".join(f"--set {o}" for o in brute.overrides()) in out
