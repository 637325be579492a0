"""The running proxy: one `Runtime` per policy generation, the `ProxyState`
that swaps generations on reload, the supervised background loops and the
app keys."""
