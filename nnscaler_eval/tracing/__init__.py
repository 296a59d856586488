"""What is true while a capture runs, shared by the tracer, the runtime functions and
the runners: which thread is tracing (`trace_state`), the patches that let the
tracer see module calls and `training` reads (`trace_patches`), the values that
stand for training flags and the numbers computed from them (`tracked_values`),
what `torch.compiler.is_compiling()` answers (`compile_awareness`), where the
user's code is (`locations`), and which torch.fx tracer records a runtime call
(`fx_tracing`).  Nothing here imports the capture, the guards or the runners.
"""
