"""Non-finite training losses on demand, for the tests of skipped steps, without a hook
in the package: a batch that holds the token POISON has a NaN loss.

`poison_loss(monkeypatch)` wraps the `make_loss_fn` that `jaxmoe.step.build` calls (build it before
`build_steps` or `train`); `poison_steps(monkeypatch, steps)` also makes the
training batches of those steps (0-based, as `TrainState.step` before the step)
hold the token, for runs through `jaxmoe.train`.
"""

import jax.numpy as jnp

POISON = 255  # a byte the standard library's source never holds


def poison_loss(monkeypatch) -> None:
    import jaxmoe.step.build as step

    make = step.make_loss_fn

    def make_poisoned(*args, **kwargs):
        loss_fn = make(*args, **kwargs)

        def poisoned(params, buffers, tokens_BxL1, *rest):
            loss, aux = loss_fn(params, buffers, tokens_BxL1, *rest)
            return jnp.where(jnp.any(tokens_BxL1 == POISON), jnp.nan, loss), aux
        return poisoned

    monkeypatch.setattr(step, "make_loss_fn", make_poisoned)


def poison_steps(monkeypatch, steps) -> None:
    import jaxmoe.train as train

    poison_loss(monkeypatch)

    class Poisoned(train.BatchIterator):
        def batch_at(self, step):
            batch = super().batch_at(step)
            if step in steps:
                batch[0, 0] = POISON
            return batch

    monkeypatch.setattr(train, "BatchIterator", Poisoned)


def poisoned(batch):
    """A copy of `batch` (numpy) that makes a NaN loss under `poison_loss`."""
    batch = batch.copy()
    batch[0, 0] = POISON
    return batch
