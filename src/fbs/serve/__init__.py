"""``fbs serve``: an OpenAI-compatible HTTP server on the FBS engine, with continuous batching.

* :mod:`fbs.serve.batcher` - slots over the engine (:class:`SlotBatch`) and the :class:`Scheduler` thread
* :mod:`fbs.serve.protocol` - OpenAI request validation and response bodies
* :mod:`fbs.serve.app` - the Starlette app, run by uvicorn (``create_app``, ``run``, ``ServerThread``)
* :mod:`fbs.serve.cli` - the ``fbs serve`` command

The server extras (starlette, uvicorn, openai) are the ``serve`` extra of the package: ``pip install -e '.[serve]'``.
See docs/serve.md.
"""
