"""A feature that needs the reduced gradient, added by a test with this one file and one entry in
FEATURES (tests/test_reduced_gradient_feature.py): in finalize, after the reduction and before the
division by N, it keeps
|grad|^2 summed over this rank's parameters and N, both on the device; read after the step."""

from __future__ import annotations

from megatron_ga_ext.integration.features import Feature, Finalizing


class ReducedGradient(Feature):
    """|sum_t grad l_t|^2 on this rank, as finalize hands it on (before the division), and N."""

    def finalize(self, step: Finalizing) -> None:
        """The reduced, undivided gradient's squared norm and N, kept on the device."""
        grads = [param.main_grad for chunk in step.model for param in chunk.parameters()]
        self.squared_norm = sum(grad.double().square().sum() for grad in grads)
        self.num_tokens = step.num_tokens
