"""fp16: float16 autocast, the low precision of cards without bf16 (T4, V100); its gradients need torch.amp.GradScaler."""

from autoplan.axes.precisions import Autocast

KIND = Autocast(name="fp16", dtype_name="float16", order=2, auto_preference=1, grad_scaler=True,
                words="fp16 autocast with torch.amp.GradScaler", missing=lambda device: "")
