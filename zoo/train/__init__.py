"""Training with Lightning: the typed recipe (``recipe``), the data module and its parts (``data``), the
LightningModule (``module``), callbacks for the time budget and throughput (``callbacks``), device and
precision choices (``device``), run directories and atomic checkpoints (``runs``) and ``fit``, one resumable
run. Imports ``zoo.models`` and ``zoo.layers``, never ``zoo.explain`` or ``zoo.bench``. Lightning and
torchmetrics load when a submodule that needs them is imported."""
