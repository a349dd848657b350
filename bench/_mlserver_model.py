"""The numpy model MLServer serves for bench/v2_protocol.py: ``sin(x) * 2 + 1``.

Imported by MLServer from its own venv (``model-settings.json`` names
``_mlserver_model.TinyModel``), never by jitserve.
"""

from __future__ import annotations

import numpy as np
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


class TinyModel(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0])
        y = (np.sin(x) * 2.0 + 1.0).astype(np.float32)
        return InferenceResponse(model_name=self.name,
                                 outputs=[NumpyCodec.encode_output("output_0", y)])
