"""Built-in attention variants, one per file, registered through the ``attention_zoo.variants`` entry
point group exactly like third-party plugins."""
