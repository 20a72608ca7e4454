"""Step-3.7-Flash's vision side: its config (``config``), the tower on megatron-core's layers
(``tower``) and where image features go in the text embeddings (``placement``)."""

from mcore_ext.vision.config import VisionConfig

__all__ = ["VisionConfig"]
