"""The common ground: what every room of the project shares and nothing of ours is imported by.

The node wire protocol (`protocol`), ed25519 keys and signatures (`keys`), the chat template that turns a
prompt into token ids (`chat`), serving an aiohttp app (`http`), atomic file writes (`atomic`) and the
config.json fix both vLLM and transformers need (`hf_config`). It imports no other package of this project.
"""
