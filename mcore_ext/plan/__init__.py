"""Memory plans: what a rank holds (weights, gradients, optimizer state, activations) at a
parallel layout, and the measure that checks them (``measure.allocation_peak``)."""
