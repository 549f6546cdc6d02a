"""Built-in dataset factories for ``[data] dataset = NAME``: ``factory(split, **[dataset] keys)`` returns
a map-style ``torch.utils.data.Dataset`` of ``(input_tensor, int_label)`` pairs for split train or val."""
