"""A grid search over mpidp's scikit-learn MLPClassifier. One process:
python examples/sklearn_grid.py; data parallel: mpiexec -n 2 python examples/sklearn_grid.py
(every rank runs the same script on the same data; each fit is shared over the ranks)."""
import os

import mpidp  # import before numpy: it sets one BLAS thread pool per rank that fits the node
import numpy as np
from sklearn.datasets import load_digits
from sklearn.model_selection import GridSearchCV
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

X, y = load_digits(return_X_y=True)
model = mpidp.sklearn.MLPClassifier(max_iter=10, batch_size=64, random_state=0)
grid = {"mlpclassifier__hidden_layer_sizes": [(32,), (64,)],
        "mlpclassifier__learning_rate_init": [0.003, 0.01]}
search = GridSearchCV(make_pipeline(StandardScaler(), model), grid, cv=3).fit(X, y)
best = search.best_estimator_[-1]
if mpidp.comm.world().rank == 0:  # every rank holds the same fitted model
    print(f"best {search.best_params_}  cv accuracy {search.best_score_:.3f}")
    print(f"first weights' checksum {np.abs(best.coefs_[0]).sum():.12f}")
    os.makedirs("out", exist_ok=True)
    best.save("out/sklearn-model.npz")
