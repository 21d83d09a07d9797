//! Small builders shared by the integration tests, so test graphs read like models.

#![allow(dead_code)]

pub mod onnx_proto;

use rookery_model::{DType, Graph, Init, Input, Node, Op, Param, ParamKind};

pub struct G(pub Graph);

impl G {
    pub fn new(input: &str, shape: &[usize], dtype: DType) -> Self {
        G(Graph {
            inputs: vec![Input {
                name: input.into(),
                shape: shape.to_vec(),
                dtype,
            }],
            ..Graph::default()
        })
    }

    pub fn param(&mut self, name: &str, shape: &[usize]) -> String {
        let fan_in = shape
            .get(1..)
            .map_or(1, |s| s.iter().product::<usize>().max(1));
        self.0.params.push(Param {
            name: name.into(),
            shape: shape.to_vec(),
            dtype: DType::F32,
            kind: ParamKind::Trainable,
            init: Init::torch_weight(fan_in),
        });
        name.into()
    }

    pub fn node(&mut self, name: &str, op: Op, inputs: &[&str]) -> String {
        self.0.nodes.push(Node {
            name: name.into(),
            op,
            inputs: inputs.iter().map(|s| s.to_string()).collect(),
        });
        name.into()
    }

    /// Linear layer with parameters `{name}.weight` / `{name}.bias`.
    pub fn linear(&mut self, name: &str, x: &str, din: usize, dout: usize) -> String {
        let w = self.param(&format!("{name}.weight"), &[dout, din]);
        let b = self.param(&format!("{name}.bias"), &[dout]);
        self.node(name, Op::Linear, &[x, &w, &b])
    }

    pub fn finish(mut self, out: &str) -> Graph {
        self.0.outputs = vec![out.into()];
        self.0
    }
}
