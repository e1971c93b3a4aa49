"""An OpenAI-compatible HTTP server for a byte LM, with continuous batching:
``python -m fastrwa.serve RUN_OR_MODEL_DIR --port 8000`` (docs/serve.md; the ``[serve]``
extra brings uvicorn). Layers: :mod:`.schema` (the request, checked) and :mod:`.responses`
(every answer, built): the protocol; :mod:`.rows` (the batch's rows on the model's decoder),
:mod:`.batcher` (the engine's thread), :mod:`.app` (the ASGI routes), :mod:`.server`
(uvicorn's server and its stop), :mod:`.cli` (the command line; :mod:`.signals` notes the
stop signals from the start of ``__main__``)."""
