"""Training methods: each supplies the micro-batches of a step and the loss of a micro-batch."""
