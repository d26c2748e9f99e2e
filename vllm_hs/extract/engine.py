"""The patched vLLM engine as an extraction sees it: `ModelFacts` (what it
needs to know of the model, from vLLM's `ModelConfig`: the one source of the
layer count, hidden size, dtype and context length), and starting and
stopping the engines of a run (`start_engine`, `stop_engine`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vllm_hs.layer_ids import LayerId
from vllm_hs.patched_vllm import import_patched_vllm

__all__ = ["ModelFacts", "start_engine", "stop_engine"]


@dataclasses.dataclass(frozen=True)
class ModelFacts:
    """What an extraction needs to know of the engine's model, from vLLM's
    `ModelConfig` (an engine's, or one built without an engine: `planned`)."""

    model: str
    fingerprint: str
    """SHA-256 of the model's config.json (identifies the model for --resume)."""
    max_model_len: int
    hidden_size: int
    dtype: str
    num_hidden_layers: int
    tokenizer: str
    tokenizer_revision: str | None
    trust_remote_code: bool
    image_token_id: int | None = None
    """The token a vision-language model's processor expands per image (the
    HF config's ``image_token_id``/``image_token_index``); None: no images."""

    @classmethod
    def of(cls, model_config: Any) -> ModelFacts:
        hf_config = model_config.hf_config
        image_token = getattr(hf_config, "image_token_id", None)
        if image_token is None:
            image_token = getattr(hf_config, "image_token_index", None)
        return cls(
            model=str(model_config.model),
            fingerprint=_model_fingerprint(model_config),
            max_model_len=int(model_config.max_model_len),
            hidden_size=int(model_config.get_hidden_size()),
            dtype=str(model_config.dtype).removeprefix("torch."),
            num_hidden_layers=int(model_config.hf_text_config.num_hidden_layers),
            tokenizer=str(model_config.tokenizer),
            tokenizer_revision=model_config.tokenizer_revision,
            trust_remote_code=bool(model_config.trust_remote_code),
            image_token_id=None if image_token is None else int(image_token),
        )

    @classmethod
    def planned(cls, model: str, engine_options: dict[str, Any]) -> ModelFacts:
        """The model as engines started with these options will see it, from
        vLLM's own `ModelConfig` built without an engine (from a copy of the
        options: EngineArgs may change the objects it is given)."""
        from vllm.engine.arg_utils import EngineArgs

        args = EngineArgs(model=model, **copy.deepcopy(engine_options))
        return cls.of(args.create_model_config())

    def differences(self, other: ModelFacts) -> dict[str, tuple[Any, Any]]:
        """field -> (mine, other's) where the two differ, ``model`` aside (the
        same files may be named by other paths)."""
        return {
            f.name: (getattr(self, f.name), getattr(other, f.name))
            for f in dataclasses.fields(self)
            if f.name != "model" and getattr(self, f.name) != getattr(other, f.name)
        }

    def load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(
            self.tokenizer,
            revision=self.tokenizer_revision,
            trust_remote_code=self.trust_remote_code,
        )


def start_engine(
    model: str, engine_options: dict[str, Any], layers: Sequence[LayerId]
) -> Any:
    """A patched `vllm.LLM` of ``model`` whose requests may ask for ``layers``."""
    llm_class = import_patched_vllm().LLM
    return llm_class(
        model=model, hidden_states_config={"layers": list(layers)}, **engine_options
    )


def stop_engine(llm: Any) -> None:
    """Shut an engine's core down (its processes too); never raises."""
    with contextlib.suppress(Exception):
        llm.llm_engine.engine_core.shutdown()


def _model_fingerprint(model_config: Any) -> str:
    """SHA-256 of the model's config.json (identifies the model for --resume)."""
    model = Path(str(model_config.model))
    config = model / "config.json"
    data = config.read_bytes() if config.exists() else str(model_config.model).encode()
    return hashlib.sha256(data).hexdigest()
