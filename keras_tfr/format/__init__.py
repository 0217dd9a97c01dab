"""The on-disk format in one place: TFRecord framing (`framing`)."""
