"""The OpenAI protocol as our servers speak it: request bodies and their bounds, the error shape,
the HTTP plumbing around a handler, and the priority classes a request may name.

The engine server and the gateway both import it, so it imports neither torch nor the engine.
"""
