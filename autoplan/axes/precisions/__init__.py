"""One file per precision, each defining `KIND` (`axes.precision.PrecisionKind`); `axes.precision` finds them all."""
