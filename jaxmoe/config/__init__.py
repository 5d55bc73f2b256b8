"""The run's configuration, by job: the sections and their keys (`sections`), what their
values must satisfy (`checks`), and reading them from YAML, dicts and `--set` overrides
(`load`). The names other code uses are imported here."""

from jaxmoe.config.checks import (MESH_AXES, ConfigError, check_context_split,
                                  check_expert_split, validate)
from jaxmoe.config.load import (config_from_dict, current_value, dropless, load_config,
                                override_config)
from jaxmoe.config.sections import (SHAPE_KEYS, CheckpointConfig, Config, DataConfig,
                                    EvalsConfig, LoggingConfig, MeshConfig, ModelConfig,
                                    MoEConfig, OptimizerConfig, PipelineConfig, TrainConfig)

__all__ = ["MESH_AXES", "SHAPE_KEYS", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
           "EvalsConfig", "LoggingConfig", "MeshConfig", "ModelConfig", "MoEConfig",
           "OptimizerConfig", "PipelineConfig", "TrainConfig", "check_context_split",
           "check_expert_split", "config_from_dict", "current_value", "dropless", "load_config",
           "override_config", "validate"]
