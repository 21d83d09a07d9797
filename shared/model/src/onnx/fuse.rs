//! The importer's second pass: PyTorch's `Transpose(W) -> MatMul -> Add(b)`
//! spelling of `nn.Linear` fused back into [`Op::Linear`], and nodes nothing
//! reads dropped.

use std::collections::{BTreeSet, HashMap, HashSet};

use crate::graph::Node;
use crate::ops::Op;

/// Rewrites `Transpose(W, [1, 0]) -> MatMul(x, ·) [-> Add(·, b)]`, PyTorch's
/// `nn.Linear` on inputs of rank > 2, into one [`Op::Linear`] named after the
/// last node it replaces.
pub(super) fn fuse_linear(
    nodes: Vec<Node>,
    params: &HashMap<String, Vec<usize>>,
    outputs: &[String],
) -> Vec<Node> {
    let mut users: HashMap<&str, usize> = HashMap::new();
    for n in &nodes {
        for i in &n.inputs {
            *users.entry(i.as_str()).or_default() += 1;
        }
    }
    let private = |t: &str| users.get(t) == Some(&1) && !outputs.iter().any(|o| o == t);
    let index: HashMap<&str, usize> = nodes
        .iter()
        .enumerate()
        .map(|(i, n)| (n.name.as_str(), i))
        .collect();
    let consumer: HashMap<&str, usize> = nodes
        .iter()
        .enumerate()
        .flat_map(|(i, n)| n.inputs.iter().map(move |t| (t.as_str(), i)))
        .collect();
    let mut remove = BTreeSet::new();
    let mut replace: HashMap<usize, Node> = HashMap::new();
    for (mi, m) in nodes.iter().enumerate() {
        if m.op != Op::MatMul || remove.contains(&mi) {
            continue;
        }
        let Some(&ti) = index.get(m.inputs[1].as_str()) else {
            continue;
        };
        let t = &nodes[ti];
        let weight = &t.inputs[0];
        let is_transposed_weight = t.op == (Op::Transpose { perm: vec![1, 0] })
            && params.get(weight).is_some_and(|s| s.len() == 2)
            && private(&t.name);
        if !is_transposed_weight {
            continue;
        }
        let out_features = params.get(weight).map_or(0, |s| s[0]);
        let x = m.inputs[0].clone();
        // The bias Add, if it is the MatMul's only reader.
        let add = consumer
            .get(m.name.as_str())
            .copied()
            .filter(|_| private(&m.name))
            .and_then(|ai| {
                let a = &nodes[ai];
                let bias = a.inputs.iter().find(|i| **i != m.name)?;
                let ok = a.op == Op::Add
                    && a.inputs.len() == 2
                    && params.get(bias).is_some_and(|s| s == &[out_features]);
                ok.then(|| (ai, bias.clone()))
            });
        remove.insert(ti);
        match add {
            Some((ai, bias)) => {
                remove.insert(mi);
                replace.insert(
                    ai,
                    Node {
                        name: nodes[ai].name.clone(),
                        op: Op::Linear,
                        inputs: vec![x, weight.clone(), bias],
                    },
                );
            }
            None => {
                replace.insert(
                    mi,
                    Node {
                        name: m.name.clone(),
                        op: Op::Linear,
                        inputs: vec![x, weight.clone()],
                    },
                );
            }
        }
    }
    nodes
        .into_iter()
        .enumerate()
        .filter(|(i, _)| !remove.contains(i))
        .map(|(i, n)| replace.remove(&i).unwrap_or(n))
        .collect()
}

/// Drops nodes whose outputs nothing reads (e.g. shape computations left over
/// from fusions), repeating until none are left.
pub(super) fn prune(mut nodes: Vec<Node>, outputs: &[String]) -> Vec<Node> {
    loop {
        let read: HashSet<&str> = nodes
            .iter()
            .flat_map(|n| n.inputs.iter().map(String::as_str))
            .chain(outputs.iter().map(String::as_str))
            .collect();
        let keep: Vec<bool> = nodes
            .iter()
            .map(|n| read.contains(n.name.as_str()))
            .collect();
        if keep.iter().all(|&k| k) {
            return nodes;
        }
        let mut k = keep.into_iter();
        nodes.retain(|_| k.next().unwrap_or(true));
    }
}
