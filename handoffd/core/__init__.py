"""The core: documents, states, error codes, config, the specialist registry and the Engine
(admit -> run -> file) with the hooks features install into. It imports no feature, no service
and no file-system code; storage comes in through the Backend interface (``core.storage``)."""
