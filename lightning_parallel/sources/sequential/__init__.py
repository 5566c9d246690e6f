"""The Sequential path: a module that holds its layers in one top-level ``nn.Sequential`` has that
Sequential split between its children, with no tracing (any Python in the layers)."""
