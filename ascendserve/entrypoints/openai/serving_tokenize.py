"""POST /tokenize and /detokenize (vLLM's extensions)."""

from ascendserve.entrypoints.openai.errors import OpenAIError
from ascendserve.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeChatRequest,
                                                     TokenizeResponse)
from ascendserve.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    """Tokenize a prompt or rendered chat, and decode token ids."""

    async def create_tokenize(self, request, chat) -> TokenizeResponse:
        """Token ids of a prompt, or of messages rendered like /v1/chat/completions renders them."""
        self.models.check_model(request.model)
        if isinstance(request, TokenizeChatRequest):
            text = chat._render(request)
        else:
            text = request.prompt
        ids = await self.tokenize(text, request.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.max_model_len, tokens=ids, token_strs=strs)

    def create_detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids; ids outside the vocabulary are a 400."""
        self.models.check_model(request.model)
        if self.tokenizer is None:
            raise OpenAIError("This server runs without a tokenizer.", 400)
        size = len(self.tokenizer)
        bad = [t for t in request.tokens if not 0 <= t < size]
        if bad:
            raise OpenAIError(f"tokens must be in [0, {size}), got {bad[:5]}", 400, param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens))
