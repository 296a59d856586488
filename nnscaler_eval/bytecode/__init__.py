"""Control flow on tensors, read from the bytecode: a code object's flow graph, its
`if` and `while` sites and their live variables (`code_graph`), the code a capture
runs in their place (`instrument`), and what differs between CPython versions in both
(`versions`, the one place that knows).  The C layer decodes and assembles the
instructions (csrc/bytecode.c); capture/branches.py and capture/loops.py use this.
"""
