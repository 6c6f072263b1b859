"""moe-infer: a mixture-of-experts specialist inference framework."""
from moe_infer.checkpoint import CheckpointError
from moe_infer.config import Config, ConfigError, EngineConfig, ModelConfig, MoEConfig, ParallelConfig
from moe_infer.config_files import load_preset, load_yaml_config
from moe_infer.engine import Completion, Engine
from moe_infer.loader import load

__all__ = ["load", "Engine", "Completion", "Config", "ModelConfig", "MoEConfig", "ParallelConfig",
           "EngineConfig", "ConfigError", "CheckpointError", "load_preset", "load_yaml_config"]
__version__ = "0.1.0"
