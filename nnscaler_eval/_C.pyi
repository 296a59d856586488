"""Type stub of the C extension nnscaler_eval._C."""
from types import CodeType
from typing import Any, Callable, Optional, Sequence

CO_EXTRA_DIRECT: int   # 1: the evaluator reads co_extra without a call into CPython
# value-guard kinds (guards/value_guards.h), the first item of a value-guard spec
VG_DICT: int
VG_LIST: int
VG_CELL: int
VG_FUNCTION: int
VG_TENSOR: int
VG_CALL: int
VG_TENSORS: int
VG_BYTES: int
VG_SLOTS: int
# shape-guard opcodes (guards/shape_guards.h)
SG_LOAD: int
SG_CONST: int
SG_ADD: int
SG_SUB: int
SG_MUL: int
SG_FLOORDIV: int
SG_MOD: int
SG_POW: int
SG_NEG: int
SG_MAX: int
SG_MIN: int
SG_EQ: int
SG_NE: int
SG_LT: int
SG_LE: int
SG_GT: int
SG_GE: int
SG_AND: int
SG_OR: int
SG_NOT: int
SG_CHECK: int
SG_CHECK_GE_CONST: int
SG_CHECK_LE_CONST: int
SG_CHECK_EQ_CONST: int
SG_CHECK_EQ_LOAD: int

class ArmToken: ...

class CacheEntry:
    info: Any
    hits: int
    guard_names: tuple[str, ...]
    runner: Optional[Callable[..., Any]]
    key_hash: int
    n_state_guards: int
    clean_clock: int
    key_description: tuple[str, ...]
    def __init__(self, runner: Optional[Callable[..., Any]], training_modules: Sequence[Any],
                 flag_guards: Sequence[tuple[Any, bool]],
                 guard_names: Sequence[str], info: Any,
                 value_guards: Sequence[tuple[Any, ...]] = ()) -> None: ...
    def check_verbose(self) -> Optional[str]: ...
    # a dynamic entry's (symbolic field offsets, shape-guard program), or None
    shape_guards: Optional[tuple[tuple[int, ...], tuple[int, ...]]]
    def set_shape_guards(self, wild: Sequence[int], code: Sequence[int], key_len: int) -> None: ...

class CacheTable:
    """The cache buckets of one code object and capture config (internal)."""

class CallKey:
    """The per-call key of argument values (C builds it on a miss for convert_frame)."""
    hash: int
    def __init__(self, *values: Any) -> None: ...

class CacheBucket:
    misses: int
    fallbacks: int
    captures: int
    hits: int
    limit_warned: int
    dead: int
    entries: list[CacheEntry]
    self: Any
    eager_types: tuple[tuple[type, str], ...]
    def take_dropped(self) -> list[str]: ...

class ModuleCall:
    config: Any
    def __init__(self, module: Any, config: Any) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

class CompiledFunction:
    config: Any
    _nnscaler_fn: Callable[..., Any]
    def __init__(self, fn: Callable[..., Any], config: Any) -> None: ...
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...

def install(ifexpr: Callable[..., Any], convert_frame: Callable[..., Any], rewrite_mode: object,
            run_eagerly: object, run_disarmed: object, module_type: type, tensor_type: type,
            is_grad_enabled: Callable[[], bool], global_hook_dicts: tuple[dict, ...],
            internal_prefix: str, len_torch_function_stack: Callable[[], int],
            pop_torch_function_stack: Callable[[], Any]) -> None: ...
def record_functions_start() -> Any: ...
def record_functions_stop(token: Any) -> tuple[set[Any], bool]: ...
def record_functions_pause() -> Any: ...
def record_functions_resume(token: Any) -> None: ...
def arm(config: Any, target: Optional[CodeType] = ..., home: Optional[list] = ...) -> ArmToken: ...
def disarm(token: ArmToken) -> None: ...
def rewrite_code(code: CodeType, ifexpr: Callable[..., Any]) -> tuple[CodeType, int]: ...
def code_state(code: CodeType) -> Optional[dict[str, Any]]: ...
def decide(code: CodeType) -> dict[str, Any]: ...
def mark_skip(code: CodeType) -> None: ...
def clear_cache(code: CodeType) -> None: ...
def eval_frame_installed() -> bool: ...
def is_default_eval_frame() -> bool: ...
def armed_threads() -> int: ...
def current_config() -> Any: ...
def dict_version(d: dict) -> int: ...
def dict_clock() -> int: ...
def recursion_depth() -> int: ...
def call_at_depth(depth: Optional[int], fn: Callable[..., Any], /, *args: Any,
                  **kwargs: Any) -> Any: ...
def call_with_mode_replaced(mode: Any, stand_in: Any, fn: Callable[..., Any], /, *args: Any,
                            **kwargs: Any) -> Any: ...
def call_holding(lock: Any, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any: ...
def _stack_room() -> tuple[int, int]: ...
def call_key_layout(key: CallKey | CacheEntry) -> tuple[tuple[Any, ...], ...]: ...
def call_key_bytes(key: CallKey | CacheEntry) -> bytes: ...
def shape_guards_match(stored: bytes, key: bytes, wild: Sequence[int],
                       code: Sequence[int]) -> bool: ...
def describe_call_key(key: CallKey | CacheEntry,
                      names: Optional[Sequence[str]] = ...) -> tuple[str, ...]: ...
