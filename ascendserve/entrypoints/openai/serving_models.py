"""The served model names: GET /v1/models and the `model` check of every request."""

from ascendserve.entrypoints.openai.errors import OpenAIError
from ascendserve.entrypoints.openai.protocol import ModelCard, ModelList, ModelPermission


class ServingModels:
    """Names a request may use for the one loaded model (the first is the canonical one)."""

    def __init__(self, served_model_names: list[str], root: str, max_model_len: int) -> None:
        self.names = list(served_model_names)
        self.root = root
        self.max_model_len = max_model_len

    @property
    def model_name(self) -> str:
        """The name put in responses."""
        return self.names[0]

    def check_model(self, name: str | None) -> str:
        """The name to answer with; raise a 404 OpenAIError for a model this server does not serve."""
        if name is None or name in self.names:
            return name or self.model_name
        raise OpenAIError(f"The model `{name}` does not exist.", 404, param="model")

    def list_models(self) -> ModelList:
        """GET /v1/models."""
        return ModelList(data=[self._card(name) for name in self.names])

    def retrieve_model(self, name: str) -> ModelCard:
        """GET /v1/models/{model} (OpenAI's `client.models.retrieve`): its card, or a 404 naming it."""
        if name not in self.names:
            raise OpenAIError(f"The model `{name}` does not exist.", 404, param="model")
        return self._card(name)

    def _card(self, name: str) -> ModelCard:
        return ModelCard(id=name, root=self.root, max_model_len=self.max_model_len, permission=[ModelPermission()])
