"""The train step, by job:

- `loss`: the loss a step differentiates, its gradients summed over accumulation
  slices, the step's metrics, the scoring forward;
- `program`: where the step runs, the auto-sharded program (fsdp) or one device's
  inside a `shard_map` (ddp), and the working copy's dtypes;
- `build`: the train state, and the init, train and scoring steps compiled once per
  (config, mesh);
- `checks`: the config's checks that need its mesh and the model's parameters;
- `weights`: weights from outside a run placed into the state, shapes checked;
- `overflow`: what a step does when its routing overflows the expert buffers.

The names other code uses are imported here.
"""

from jaxmoe.step.build import Steps, TrainState, abstract_model, apply_gradients, build_steps
from jaxmoe.step.checks import uses_per_device_step
from jaxmoe.step.weights import check_shapes, place_weights, with_weights

__all__ = ["Steps", "TrainState", "abstract_model", "apply_gradients", "build_steps",
           "check_shapes", "place_weights", "uses_per_device_step", "with_weights"]
