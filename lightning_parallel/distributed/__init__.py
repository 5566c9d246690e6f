"""Where ranks agree: failure handling (``agree``) and the coalesced collectives of the plugins."""
