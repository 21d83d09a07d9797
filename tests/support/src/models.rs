//! Model specs (rookery's TOML layer lists) for tests.

/// A spec of Dense layers on inputs of `input` features: `(units,
/// activation)` per layer, in order.
pub fn dense_mlp(input: usize, layers: &[(usize, Option<&str>)]) -> String {
    let mut spec = format!("input_shape = [{input}]\n");
    for (units, activation) in layers {
        spec.push_str(&format!("[[layers]]\ntype = \"Dense\"\nunits = {units}\n"));
        if let Some(activation) = activation {
            spec.push_str(&format!("activation = \"{activation}\"\n"));
        }
    }
    spec
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_dense_mlp_is_the_spec_a_person_would_write() {
        assert_eq!(
            dense_mlp(6, &[(16, Some("relu")), (3, None)]),
            "input_shape = [6]\n\
             [[layers]]\ntype = \"Dense\"\nunits = 16\nactivation = \"relu\"\n\
             [[layers]]\ntype = \"Dense\"\nunits = 3\n"
        );
        let graph = rookery_model::from_toml(&dense_mlp(6, &[(16, Some("tanh")), (3, None)]));
        assert!(graph.is_ok(), "{graph:?}");
    }
}
