"""Request bodies (pydantic) of the OpenAI-compatible and native APIs, and the field types they share:
strict integers and booleans, bounded counts; `null` for a field with a default means that default;
a `Strict` body answers a field it does not know with a 400 naming it. `server/protocol.py` loads
the JSON and turns a validation error into that 400 (`parse_body`)."""
from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from hicache.runtime.grammar import JSON_OBJECT_SCHEMA
from hicache.server.protocol import INT64_MAX, INT64_MIN, APIError
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, model_validator

INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20  # top alternatives per token, as OpenAI

# ---- field types ----------------------------------------------------------------------------

Int64 = Annotated[StrictInt, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenCount = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
TopLogprobs = Annotated[StrictInt, Field(ge=0, le=MAX_LOGPROBS)]
Rid = Annotated[str, Field(max_length=512)]
Port = Annotated[StrictInt, Field(ge=1, le=65535)]
Room = Annotated[StrictInt, Field(ge=0, le=2**64 - 1)]
Host = Annotated[StrictStr, Field(min_length=1, max_length=255)]
MAX_N = 128  # samples per prompt


class Body(BaseModel):
    """A request body: `null` for a field with a non-null default means that default (OpenAI's
    clients send null for options they leave unset); a required field stays required."""

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or _null_allowed(cls, k)}


class Strict(Body):
    """A body whose unknown fields are a 400 naming them."""

    model_config = ConfigDict(extra="forbid")


def _null_allowed(cls: type[BaseModel], name: str) -> bool:
    """Whether `name: null` stays in the body: not for a field with a non-null default, nor for a
    field that a `Strict` body does not know (null asks for nothing)."""
    f = cls.model_fields.get(name)
    if f is None:
        return cls.model_config.get("extra") != "forbid"
    return f.is_required() or f.default is None


# ---- OpenAI ---------------------------------------------------------------------------------


class StreamOptions(Strict):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False  # with include_usage: the usage so far in every chunk


class ContentPart(Strict):
    type: Literal["text"]
    text: str


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[str, list[ContentPart]]] = None
    name: Optional[str] = None  # passed to the chat template, which may render it
    tool_calls: Optional[list[Any]] = None  # assistant turns; checked by server/tools.py
    tool_call_id: Optional[str] = None  # tool turns

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class JsonSchemaFormat(Strict):
    name: Optional[str] = None
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None  # outputs always follow the schema


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    def schema_text(self) -> str | None:
        """The JSON schema the output must follow (sampling's `json_schema`), None for text."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return JSON_OBJECT_SCHEMA
        if self.json_schema is None or self.json_schema.schema_ is None:
            raise APIError(400, "response_format.json_schema.schema is required for type json_schema",
                           param="response_format.json_schema.schema", code="invalid_value")
        return json.dumps(self.json_schema.schema_)


class RouterDefaults(Strict):
    """Fields that SGLang's router (`sglang-router`) sets in every body it forwards: accepted where
    they ask for nothing this server does not do (False), or where they change no answer (logging
    switches; reasoning switches, with no reasoning parser here)."""

    return_hidden_states: Optional[Literal[False]] = None
    log_metrics: Optional[StrictBool] = None
    no_logs: Optional[StrictBool] = None
    separate_reasoning: Optional[StrictBool] = None
    stream_reasoning: Optional[StrictBool] = None
    # its PD mode's: the prefill server's bootstrap address and the room pairing the request's
    # halves (one per prompt on a batched /generate); acted on by disaggregated servers only
    bootstrap_host: Optional[Union[Host, list[Host]]] = None
    bootstrap_port: Optional[Union[Port, list[Optional[Port]]]] = None
    bootstrap_room: Optional[Union[Room, list[Room]]] = None


class SamplingFields(RouterDefaults):
    """Decoding options shared by both OpenAI endpoints (SGLang's extensions included)."""

    model: Optional[str] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[Int64] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: Optional[StrictBool] = None
    skip_special_tokens: Optional[StrictBool] = None
    no_stop_trim: Optional[StrictBool] = None
    seed: Optional[Int64] = None
    n: StrictInt = Field(default=1, ge=1, le=MAX_N)
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None  # prefixes are cached whatever the key
    safety_identifier: Optional[str] = None
    store: Optional[Literal[False]] = None  # completions are never stored
    cache_salt: Optional[str] = None
    lora_path: Optional[StrictStr] = None  # SGLang's: a LoRA adapter's name, as `model` may give it
    rid: Optional[Rid] = None
    response_format: Optional[ResponseFormat] = None
    logit_bias: Optional[dict[str, Any]] = None  # token id (a string of digits) -> bias in [-100, 100]

    def sampling_dict(self) -> dict[str, Any]:
        keys = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                "presence_penalty", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                "no_stop_trim", "seed", "logit_bias")
        d = {k: getattr(self, k) for k in keys if getattr(self, k) is not None}
        schema = self.response_format.schema_text() if self.response_format is not None else None
        if schema is not None:
            d["json_schema"] = schema
        return d

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Optional[TokenCount] = None  # null: as many as fit the context
    max_completion_tokens: Optional[TokenCount] = None
    logprobs: StrictBool = False
    top_logprobs: Optional[TopLogprobs] = None
    tools: Optional[list[Any]] = None  # checked, with the two below, by server/tools.py
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: StrictBool = True
    continue_final_message: Optional[Literal[False]] = None


PromptType = Union[str, list[str], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(SamplingFields):
    prompt: PromptType
    max_tokens: TokenCount = 16  # OpenAI's default, also for null
    echo: StrictBool = False
    logprobs: Optional[TopLogprobs] = None
    suffix: Optional[str] = None
    best_of: Optional[StrictInt] = None  # only n: the best n of n samples are all of them


# ---- native ---------------------------------------------------------------------------------


class SGLangClientDefaults(RouterDefaults):
    """Fields of SGLang's /generate body that its own clients send (`bench_serving`, the frontend
    language's `RuntimeEndpoint`): accepted at the value that asks for nothing (false, null); any
    other value asks for what this server does not do (routed experts, log-probs of chosen token
    ids, images, sessions), a 400 naming the field."""

    return_routed_experts: Optional[Literal[False]] = None
    token_ids_logprob: None = None
    image_data: None = None
    session_id: None = None


class GenerateReqInput(SGLangClientDefaults):
    """SGLang's /generate body: the fields hicache acts on (any other is a 400 naming it)."""

    text: Optional[Union[str, list[str]]] = None
    input_ids: Optional[Union[list[StrictInt], list[list[StrictInt]]]] = None
    lora_path: Optional[Union[StrictStr, list[Optional[StrictStr]]]] = None  # an adapter's name, or one per prompt
    sampling_params: Optional[dict[str, Any]] = None
    stream: StrictBool = False
    rid: Optional[Rid] = None
    return_logprob: StrictBool = False
    top_logprobs_num: TopLogprobs = 0
    logprob_start_len: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] = -1
    return_text_in_logprobs: StrictBool = False
    cache_salt: Optional[str] = None
    extra_key: Optional[str] = None
    routed_dp_rank: Optional[Annotated[StrictInt, Field(ge=0)]] = None  # the replica, under --dp-size
    data_parallel_rank: Optional[Annotated[StrictInt, Field(ge=0)]] = None  # SGLang's older name of it
    background: Optional[Literal[False]] = None
    return_bytes: Optional[Literal[False]] = None
    return_entropy: Optional[Literal[False]] = None


AdapterName = Annotated[StrictStr, Field(min_length=1, max_length=256)]


class LoadLoraAdapterReqInput(Strict):
    """SGLang's `/load_lora_adapter` body. `pinned` (keep the adapter in GPU memory) is accepted
    either way: every loaded adapter stays in GPU memory until unloaded."""

    lora_name: AdapterName
    lora_path: Annotated[StrictStr, Field(min_length=1, max_length=4096)]
    pinned: Optional[StrictBool] = None


class UnloadLoraAdapterReqInput(Strict):
    lora_name: AdapterName


class AbortReqInput(Strict):
    rid: Rid = ""
    abort_all: StrictBool = False


StepCount = Union[TokenCount, Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]]  # SGLang's clients send digits


class ProfileReqInput(Strict):
    """SGLang's `/start_profile` body (`runtime.profiler.ProfileSpec`). By-stage profiles and
    activities other than CPU and GPU are refused with a 400 naming them."""

    output_dir: Optional[Annotated[str, Field(max_length=4096)]] = None
    num_steps: Optional[StepCount] = None
    start_step: Optional[StepCount] = None
    activities: Optional[list[Annotated[str, Field(max_length=32)]]] = None
    profile_by_stage: Optional[StrictBool] = None
    profile_stages: Optional[list[str]] = None
    profile_prefix: Optional[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]] = None
    with_stack: Optional[StrictBool] = None
    record_shapes: Optional[StrictBool] = None

    def spec(self, default_dir: str) -> dict:
        """The `ProfileSpec` fields; APIError 400 for what it cannot do."""
        if self.profile_by_stage or self.profile_stages:
            raise APIError(400, "profile_by_stage is not supported: profiles record whole scheduler steps",
                           param="profile_by_stage", code="unsupported_value")
        spec = {"output_dir": self.output_dir or default_dir, "prefix": self.profile_prefix or "hicache",
                "start_step": int(self.start_step or 0), "with_stack": bool(self.with_stack),
                "record_shapes": bool(self.record_shapes)}
        if self.num_steps is not None:
            spec["num_steps"] = int(self.num_steps)
        if self.activities:
            spec["activities"] = list(self.activities)
        return spec
