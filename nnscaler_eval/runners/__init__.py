"""What runs on a cache hit: the straight-line Python a captured graph becomes
(`codegen`), the torch entry points it calls directly (`direct_calls`), how an opaque
submodule node is called (`module_calls`), the `backend=` argument
resolved to a callable (`backends`), the graph handed to a `torch.compile` backend in
the form Dynamo hands it, which torch's compiler caches need (`backend_form`), and the
release of what torch.fx keeps for every GraphModule (`fx_source`), and the size
buckets with padding a graph recorded per size may use (`size_buckets`, its rules in
`padding_rules`).
"""
