"""Config loading: errors name the key; derived counts match the real model."""

from pathlib import Path

import jax
import pytest
from flax import nnx

from jaxmoe.config import Config, ConfigError, config_from_dict, load_config
from jaxmoe.plan.counts import param_counts
from jaxmoe.model.transformer import Transformer

ROOT = Path(__file__).parents[2]


@pytest.mark.parametrize("raw, key", [
    ({"moe": {"top_k": 9, "num_experts": 8}}, "moe.top_k"),
    ({"model": {"num_heads": 6, "num_kv_heads": 4}}, "model.num_heads"),
    ({"model": {"d_model": 100, "num_heads": 8, "num_kv_heads": 8}}, "model.d_model"),
    ({"model": {"d_model": "wide"}}, "model.d_model"),
    ({"model": {"qk_norm": 1}}, "model.qk_norm"),
    ({"moe": {"dispatcher": "magic"}}, "moe.dispatcher"),
    ({"moe": {"expertz": 4}}, "moe.expertz"),
    ({"optimiser": {}}, "optimiser"),
    ({"train": {"batch_size": 10, "accumulation_steps": 4}}, "train.accumulation_steps"),
    ({"model": {"num_dense_layers": 9}}, "model.num_dense_layers"),
    ({"mesh": {"expert": 3}}, "moe.num_experts"),
    ({"mesh": {"data": -1, "expert": -1}}, "mesh"),
    ({"data": {"source": "tokens"}}, "data.path"),
    ({"train": {"steps": 10}, "optimizer": {"warmup_steps": 20}}, "optimizer.warmup_steps"),
    ({"moe": {"capacity_factor": -1.0}}, "moe.capacity_factor"),
])
def test_bad_values_name_the_key(raw, key):
    with pytest.raises(ConfigError, match=f"^{key}"):
        config_from_dict(raw)


@pytest.mark.parametrize("old", ["train.microbatches=2", "pipeline.microbatches=2"])
def test_the_two_microbatch_keys_are_refused_naming_their_successors(old):
    """One word meant gradient accumulation in `train` and pipeline micro-batches in
    `pipeline`; each old key now fails and names both new ones."""
    with pytest.raises(ConfigError, match=f"^{old.split('=')[0]}: renamed") as e:
        config_from_dict({}, [old])
    assert "train.accumulation_steps" in str(e.value)
    assert "pipeline.stage_microbatches" in str(e.value)
    cfg = config_from_dict({}, ["train.accumulation_steps=2", "pipeline.stage_microbatches=2"])
    assert (cfg.train.accumulation_steps, cfg.pipeline.stage_microbatches) == (2, 2)


def test_the_schedule_key_and_its_older_spelling():
    """pipeline.schedule: "circular" (GPipe with one virtual stage, which older configs
    spell "gpipe") or "1f1b", whose needs are named when a config lacks them."""
    circular = {"mesh": {"data": 2, "stage": 2}, "train": {"batch_size": 8},
                "pipeline": {"stage_microbatches": 2, "virtual_stages": 2}}
    old = {**circular, "pipeline": {**circular["pipeline"], "schedule": "circular"}}
    assert config_from_dict(old) == config_from_dict(circular)
    assert config_from_dict({"pipeline": {"schedule": "gpipe"}}) == config_from_dict({})
    with pytest.raises(ConfigError, match="^pipeline.schedule: 'gpipe' disagrees with "
                                          "virtual_stages=2, which means 'circular'"):
        config_from_dict({**circular, "pipeline": {**circular["pipeline"], "schedule": "gpipe"}})
    with pytest.raises(ConfigError, match="^pipeline.schedule: 'zb' is not one of"):
        config_from_dict({}, ["pipeline.schedule=zb"])
    one_f_one_b = {**circular, "train": {"batch_size": 8, "remat": "full"},
                   "pipeline": {**circular["pipeline"], "schedule": "1f1b"}}
    assert config_from_dict(one_f_one_b).pipeline.schedule == "1f1b"
    for overrides, named in ((["mesh.stage=-1", "pipeline.virtual_stages=1"], "needs an "
                              "explicit stage count"),
                             (["mesh.parallelism=fsdp"], "runs in the ddp step"),
                             (["train.remat=none"], "train.remat must be 'full', not 'none'"),
                             (["mesh.stage=4", "mesh.data=1", "pipeline.stage_microbatches=6",
                               "train.batch_size=12", "model.num_layers=9"],
                              "= 6.* in groups of mesh.stage = 4")):
        with pytest.raises(ConfigError, match=f"^pipeline.schedule: .*{named}"):
            config_from_dict(one_f_one_b, overrides)
    # without stages there is nothing to schedule: a 1F1B run's config loads on one
    # device as its checkpoint's readers override it (`api.local_config`, evaluation)
    one = config_from_dict(one_f_one_b, ["mesh.stage=1", "pipeline.virtual_stages=1",
                                         "train.remat=none", "mesh.parallelism=fsdp"])
    assert one.pipeline.schedule == "1f1b"


def test_yaml_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_overrides_and_immutability(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("moe:\n  num_experts: 8\n")
    cfg = load_config(path, ["moe.num_experts=32", "optimizer.learning_rate=1e-3", "train.remat=full"])
    assert cfg.moe.num_experts == 32 and cfg.optimizer.learning_rate == 1e-3
    assert cfg.train.remat == "full"
    with pytest.raises(ConfigError, match="^moe.top_k"):
        load_config(path, ["moe.top_k=64"])
    with pytest.raises(ConfigError, match="expected section.key=value"):
        load_config(path, ["moe.top_k"])
    with pytest.raises(Exception):
        cfg.moe.num_experts = 4  # frozen


def test_shipped_configs_load():
    from pathlib import Path
    configs = sorted(Path(__file__).parents[2].joinpath("configs").glob("*.yaml"))
    assert configs
    for path in configs:
        assert isinstance(load_config(path), Config)


@pytest.mark.parametrize("raw", [
    {},
    {"model": {"num_dense_layers": 2, "num_layers": 3, "qk_norm": False},
     "moe": {"shared_expert_hidden": 48, "expert_bias": True, "num_experts": 6, "top_k": 3}},
    {"model": {"num_dense_layers": 2, "num_layers": 2}},
    {"model": {"qk_norm": "full", "num_kv_heads": 1}},
    # MLA with a query bottleneck, and two multi-token prediction modules
    {"model": {"attention": "mla", "qk_norm": "none", "num_kv_heads": 4, "q_lora_rank": 24,
               "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
               "v_head_dim": 12, "mtp_layers": 2, "num_dense_layers": 1},
     "moe": {"shared_expert_hidden": 48}},
    {"model": {"mtp_layers": 1, "num_dense_layers": 2, "num_layers": 2}},  # dense modules
])
def test_param_counts_match_model(raw):
    cfg = config_from_dict(raw)
    model = nnx.eval_shape(lambda: Transformer.of(cfg, nnx.Rngs(0)))
    params = nnx.state(model, nnx.Param)
    total = sum(x.size for x in jax.tree.leaves(params))
    counts = param_counts(cfg)
    assert counts.total == total
    # active = total minus the experts a token does not visit
    experts = sum(x.size for path, x in jax.tree.leaves_with_path(params)
                  if "experts" in jax.tree_util.keystr(path))
    E, K = cfg.moe.num_experts, cfg.moe.top_k
    assert counts.active == total - experts * (E - K) // E
    if cfg.num_moe_layers:
        assert counts.active < counts.total


@pytest.mark.parametrize("experts, total", [(8, 4.6e9), (64, 24.3e9), (128, 47e9)])
def test_reference_family_parameter_counts(experts, total):
    from pathlib import Path
    cfg = load_config(Path(__file__).parents[2] / "configs" / f"olmoe_8layer_e{experts}.yaml")
    counts = param_counts(cfg)
    assert counts.total == pytest.approx(total, rel=0.02)
    assert counts.active == pytest.approx(3.2e9, rel=0.02)  # the same for every expert count


@pytest.mark.parametrize("name, total, mesh, experts", [
    ("moe_1200b_512gpu", 1.2e12, (8, 8, 8), 128),
    ("moe_2400b_512gpu", 2.4e12, (2, 32, 8), 256),  # the capacity test: EP 32
])
def test_trillion_config_parameter_counts(name, total, mesh, experts):
    from pathlib import Path
    cfg = load_config(Path(__file__).parents[2] / "configs" / f"{name}.yaml")
    counts = param_counts(cfg)
    assert counts.total == pytest.approx(total, rel=0.05)
    assert counts.active == pytest.approx(58e9, rel=0.05)
    assert (cfg.mesh.data, cfg.mesh.expert, cfg.mesh.stage) == mesh
    assert cfg.moe.num_experts == experts
    assert cfg.moe.expert_precision == "mxfp8" and cfg.train.remat == "full"
    assert cfg.num_moe_layers == 62


def _matmul_params_per_token(cfg):
    """Weights one token multiplies through, from the real model's shapes: every
    parameter but the embedding table (a lookup) and the norm scales (elementwise),
    with the routed experts counted at top_k of num_experts."""
    model = nnx.eval_shape(lambda: Transformer.of(cfg, nnx.Rngs(0)))
    total = 0.0
    for path, x in jax.tree.leaves_with_path(nnx.state(model, nnx.Param)):
        name = jax.tree_util.keystr(path)
        if name.startswith("['embed']") or "norm" in name:
            continue
        total += x.size * (cfg.moe.top_k / cfg.moe.num_experts if "['experts']" in name else 1)
    return total


FLOP_CONFIGS = [  # routed experts only; and dense layers plus a shared expert
    {"model": {"d_model": 64, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2},
     "moe": {"num_experts": 8, "top_k": 2, "expert_hidden": 32}, "train": {"seq_len": 128}},
    {"model": {"d_model": 64, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "head_dim": 16,
               "num_dense_layers": 2, "mlp_hidden": 96},
     "moe": {"num_experts": 6, "top_k": 3, "expert_hidden": 48, "shared_expert_hidden": 40},
     "train": {"seq_len": 64}},
]


@pytest.mark.parametrize("raw", FLOP_CONFIGS, ids=["routed", "dense_and_shared"])
def test_flops_per_token_counts_the_model_it_describes(raw):
    """6 x active matmul parameters + PaLM's attention term: QK^T and AV are 2
    multiply-adds per (query, key, head, head-dim) each, 4 * L * H * hd forward per
    token, times 3 with the backward."""
    from jaxmoe.plan.counts import flops_per_token
    cfg = config_from_dict(raw)
    m = cfg.model
    attention = 12 * m.num_layers * m.num_heads * m.head_size * cfg.train.seq_len
    assert flops_per_token(cfg) == pytest.approx(
        6 * _matmul_params_per_token(cfg) + attention, rel=1e-12)


@pytest.mark.parametrize("raw", FLOP_CONFIGS, ids=["routed", "dense_and_shared"])
def test_flops_per_token_moves_with_top_k_seq_len_and_shared_expert(raw):
    """Each knob changes the count by exactly the weights or scores it adds."""
    from jaxmoe.config import override_config
    from jaxmoe.plan.counts import flops_per_token
    cfg = config_from_dict(raw)
    m, moe = cfg.model, cfg.moe
    base = flops_per_token(cfg)
    # one more expert per token: its three D x F matrices in every MoE layer
    more_k = override_config(cfg, [f"moe.top_k={moe.top_k + 1}"])
    expert = 3 * m.d_model * moe.expert_hidden
    assert flops_per_token(more_k) - base == 6 * cfg.num_moe_layers * expert
    # experts a token does not visit cost nothing (only the router's new column)
    more_e = override_config(cfg, [f"moe.num_experts={moe.num_experts + 2}"])
    assert flops_per_token(more_e) - base == 6 * cfg.num_moe_layers * m.d_model * 2
    # attention grows with the context, the weights do not
    longer = override_config(cfg, [f"train.seq_len={2 * cfg.train.seq_len}"])
    assert (flops_per_token(longer) - base
            == 12 * m.num_layers * m.num_heads * m.head_size * cfg.train.seq_len)
    # a shared expert of width S: three D x S matrices per MoE layer
    wider = override_config(cfg, [f"moe.shared_expert_hidden={moe.shared_expert_hidden + 8}"])
    assert flops_per_token(wider) - base == 6 * cfg.num_moe_layers * 3 * m.d_model * 8


def test_deepseek_v3_counted_as_each_anchor_counts_it():
    """DeepSeek-V3 at 4,096 tokens, by hand from each framework's own formula.
    Megatron-LM / Megatron-Bridge (`num_floating_point_operations`): SwiGLU MLPs without
    the router, MLA projections with their latent norms, causal attention (half),
    the MTP module as a layer plus its projection, norms and another LM head; NVIDIA's
    published DeepSeek-V3 rows divide to 260.0 GFLOP per token. MaxText
    (`calculate_tflops_training_per_device`): the router counted, causal attention,
    no MTP. PaLM's counts the attention whole. Companion: the three differ."""
    from jaxmoe.config import load_config
    from jaxmoe.plan.counts import flops_per_token
    cfg = load_config(ROOT / "configs" / "deepseek_v3_671b.yaml")
    d, L, Ld, H, V, S = 7168, 61, 3, 128, 129280, 4096
    n, r, v, ql, kvl = 128, 64, 128, 1536, 512
    E, K, Fe, Fs, F, M = 256, 8, 2048, 2048, 18432, 1
    Lm = L - Ld
    mla = ql * (d + H * (n + r)) + kvl * (d + H * (n + v)) + d * r + H * v * d
    megatron = (6 * d * (3 * F * Ld + 3 * (K * Fe + Fs) * (Lm + M))
                + 6 * (L + M) * (mla + ql + kvl)  # + the latents' norms
                + 3 * (L + M) * S * H * (n + r + v)
                + 6 * M * (3 * d + 2 * d * d) + 6 * d * V * (M + 1))
    maxtext = (3 * (6 * d * F * Ld + (2 * d * E + 6 * d * Fe * K + 6 * d * Fs) * Lm
                    + L * 2 * mla + 2 * d * V)
               + 3 * L * S * H * (n + r + v))
    assert flops_per_token(cfg, "megatron") == megatron == 259_992_950_784
    assert flops_per_token(cfg, "maxtext") == maxtext == 250_449_887_232
    palm = flops_per_token(cfg)
    # PaLM's: the attention whole (L + M layers), the router counted
    assert palm - flops_per_token(cfg, "megatron") == (
        3 * (L + M) * S * H * (n + r + v) + 6 * d * E * (Lm + M)
        - 6 * (L + M) * (ql + kvl) - 6 * M * 3 * d)
    with pytest.raises(ValueError, match="count: 'nvidia'"):
        flops_per_token(cfg, "nvidia")


def test_older_boolean_qk_norm_reads_as_its_name():
    assert config_from_dict({"model": {"qk_norm": True}}).model.qk_norm == "head"
    assert config_from_dict({"model": {"qk_norm": False}}).model.qk_norm == "none"
    with pytest.raises(ConfigError, match="model.qk_norm"):
        config_from_dict({"model": {"qk_norm": "yes"}})


def test_a_key_repeated_in_one_section_is_refused(tmp_path):
    """YAML's plain loader keeps the last of two `steps:`; the config loader names both
    lines. The same key in two sections is two keys."""
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  steps: 5\n  batch_size: 8\n  steps: 50\nmesh:\n  data: 1\n")
    with pytest.raises(ConfigError, match=r"key 'steps' appears twice in one section "
                                          r"\(lines 2 and 4\)"):
        load_config(path)
    path.write_text("train:\n  steps: 50\nmesh:\n  data: 1\ndata:\n  source: stdlib\n")
    assert load_config(path).train.steps == 50


@pytest.mark.parametrize("steps", [0, -5])
def test_steps_that_are_not_positive_read_alike(steps):
    with pytest.raises(ConfigError, match=f"^train.steps: must be positive, got {steps}$"):
        config_from_dict({}, [f"train.steps={steps}"])


def test_a_mesh_larger_than_the_cpu_devices_names_the_fake_device_flag():
    from jaxmoe.parallel.sharding import make_mesh
    n = jax.device_count()
    with pytest.raises(ConfigError, match="xla_force_host_platform_device_count=") as e:
        make_mesh(config_from_dict({"moe": {"num_experts": 2 * n},
                                    "mesh": {"expert": 2 * n}}).mesh)
    assert "mesh" in str(e.value)
    assert make_mesh(config_from_dict({"moe": {"num_experts": n},
                                       "mesh": {"expert": n}}).mesh).size == n
