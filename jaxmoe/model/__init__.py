"""The model, as pure nnx modules: router, dispatch, experts, attention, the scanned
transformer, decoding and sampling. Nothing here knows the mesh: calls take a layout
(`jaxmoe.parallel`)."""
