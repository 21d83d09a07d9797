//! The Winograd products on the CPU in f64, through the same matrices as
//! the kernels: the stage's CPU backend, the checks' references, and (on
//! magnitudes) the scale of each output's rounding error.

use super::{Chunk, MAX_PARTS, MAX_TEMP_BYTES, Winograd, matrices, transpose};

/// `L X R^T` in f64, or with every coefficient by its magnitude.
fn sandwich_f64(l: &[Vec<f64>], r: &[Vec<f64>], x: &[Vec<f64>], magnitudes: bool) -> Vec<Vec<f64>> {
    let c = |v: f64| if magnitudes { v.abs() } else { v };
    let t: Vec<Vec<f64>> = l
        .iter()
        .map(|row| {
            (0..x[0].len())
                .map(|col| row.iter().zip(x).map(|(&a, xr)| c(a) * xr[col]).sum())
                .collect()
        })
        .collect();
    t.iter()
        .map(|trow| {
            r.iter()
                .map(|rrow| rrow.iter().zip(trow).map(|(&a, &v)| c(a) * v).sum())
                .collect()
        })
        .collect()
}

/// The `size x size` patch of channel `ch` of image `nb` of `img`
/// (`[n, channels, h, w]`) from `(y0, x0)`, zero outside the image.
fn patch(
    img: &[f32],
    [channels, h, w]: [usize; 3],
    (nb, ch): (usize, usize),
    (y0, x0): (isize, isize),
    size: usize,
    magnitudes: bool,
) -> Vec<Vec<f64>> {
    (0..size)
        .map(|r| {
            (0..size)
                .map(|c| {
                    let (y, x) = (y0 + r as isize, x0 + c as isize);
                    if y < 0 || x < 0 || y >= h as isize || x >= w as isize {
                        return 0.0;
                    }
                    let at = ((nb * channels + ch) * h + y as usize) * w + x as usize;
                    magnitude(img[at], magnitudes)
                })
                .collect()
        })
        .collect()
}

/// Writes `grid`, the transform of one `(row, col)` pair, where the GEMMs
/// read it: element `e = r * a + c` at `[(e * rows + row) * cols + col]`.
fn scatter(
    buf: &mut [f64],
    grid: &[Vec<f64>],
    (rows, row): (usize, usize),
    (cols, col): (usize, usize),
) {
    for (e, value) in grid.iter().flatten().enumerate() {
        buf[(e * rows + row) * cols + col] = *value;
    }
}

/// The `a x a` grid [`scatter`] wrote.
fn gather(
    buf: &[f64],
    a: usize,
    (rows, row): (usize, usize),
    (cols, col): (usize, usize),
) -> Vec<Vec<f64>> {
    (0..a)
        .map(|r| {
            (0..a)
                .map(|c| buf[((r * a + c) * rows + row) * cols + col])
                .collect()
        })
        .collect()
}

fn magnitude(v: f32, magnitudes: bool) -> f64 {
    let v = f64::from(v);
    if magnitudes { v.abs() } else { v }
}

/// Roundings of one `L X R^T` along its longest path: per side, the most
/// terms a row adds, one multiply, one coefficient rounded to f32.
fn sandwich_levels(l: &[Vec<f64>], r: &[Vec<f64>]) -> usize {
    let side = |m: &[Vec<f64>]| {
        m.iter()
            .map(|row| row.iter().filter(|&&c| c != 0.0).count())
            .max()
            .unwrap_or(1)
            + 1
    };
    side(l) + side(r)
}

impl Winograd {
    /// `chunk`'s transformed output gradient `dm [elems, cout, t]` in f64;
    /// with `magnitudes`, of `|dy|` through `|A|`.
    pub fn grad_output_values(&self, chunk: Chunk, dy: &[f32], magnitudes: bool) -> Vec<f64> {
        let mx = matrices(self.tile);
        let a_mat = transpose(&mx.at);
        let m = self.tile;
        let t_len = self.tiles_of(chunk);
        let mut dm = vec![0.0; self.elems() * self.cout * t_len];
        for co in 0..self.cout {
            for ti in 0..t_len {
                let (nb, ty, tx) = self.tile_at(chunk, ti);
                let origin = ((ty * m) as isize, (tx * m) as isize);
                let e = patch(
                    dy,
                    [self.cout, self.oh, self.ow],
                    (nb, co),
                    origin,
                    m,
                    magnitudes,
                );
                let q = sandwich_f64(&a_mat, &a_mat, &e, magnitudes);
                scatter(&mut dm, &q, (self.cout, co), (t_len, ti));
            }
        }
        dm
    }

    /// `chunk`'s weight gradient in the transform's terms,
    /// `du [elems, cout, cin]`, in f64.
    pub fn weight_grad_products(&self, chunk: Chunk, dm: &[f64], v: &[f64]) -> Vec<f64> {
        let t_len = self.tiles_of(chunk);
        let (cin, cout) = (self.cin, self.cout);
        let mut du = vec![0.0; self.u_len()];
        for z in 0..self.elems() {
            for co in 0..cout {
                let a = &dm[(z * cout + co) * t_len..][..t_len];
                for ci in 0..cin {
                    let b = &v[(z * cin + ci) * t_len..][..t_len];
                    du[(z * cout + co) * cin + ci] = a.iter().zip(b).map(|(x, y)| x * y).sum();
                }
            }
        }
        du
    }

    /// Adds `G^T du G` of each filter to `dweight [cout, cin, 3, 3]`; with
    /// `magnitudes`, through `|G|`.
    pub fn weight_grad_values(&self, du: &[f64], magnitudes: bool, dweight: &mut [f64]) {
        let mx = matrices(self.tile);
        let gt = transpose(&mx.g);
        let a = self.tile + 2;
        for co in 0..self.cout {
            for ci in 0..self.cin {
                let f = gather(du, a, (self.cout, co), (self.cin, ci));
                let w = sandwich_f64(&gt, &gt, &f, magnitudes);
                for (tap, value) in w.iter().flatten().enumerate() {
                    dweight[(co * self.cin + ci) * 9 + tap] += value;
                }
            }
        }
    }

    /// The weight gradient computed on the CPU in f64 through the same
    /// transforms as the kernels; with `magnitudes`, the magnitude sums
    /// (see [`Self::reference`]).
    pub fn weight_grad_reference(&self, x: &[f32], dy: &[f32], magnitudes: bool) -> Vec<f64> {
        let mut dweight = vec![0.0; self.cout * self.cin * 9];
        for chunk in self.chunks() {
            let v = self.input_values(chunk, x, magnitudes);
            let dm = self.grad_output_values(chunk, dy, magnitudes);
            let du = self.weight_grad_products(chunk, &dm, &v);
            self.weight_grad_values(&du, magnitudes, &mut dweight);
        }
        dweight
    }

    /// Roundings along the longest path to a weight gradient: both
    /// transforms', the product (1), the sum over every tile of the batch
    /// (in parts, then the parts and the chunks), the inverse transform's.
    pub fn weight_grad_rounding_levels(&self) -> usize {
        let mx = matrices(self.tile);
        let (a_mat, gt) = (transpose(&mx.at), transpose(&mx.g));
        let (th, tw) = self.tiles();
        sandwich_levels(&a_mat, &a_mat)
            + sandwich_levels(&mx.bt, &mx.bt)
            + 1
            + self.n * th * tw
            + MAX_PARTS
            + self.chunks().len()
            + sandwich_levels(&gt, &gt)
    }

    /// The transformed weight `u [elems, cout, cin]` in f64 from the
    /// forward weight; with `magnitudes`, of `|weight|` through `|G|`.
    pub fn weight_values(&self, weight: &[f32], magnitudes: bool) -> Vec<f64> {
        let mx = matrices(self.tile);
        let mut u = vec![0.0; self.u_len()];
        for co in 0..self.cout {
            for ci in 0..self.cin {
                let g: Vec<Vec<f64>> = (0..3)
                    .map(|ky| {
                        (0..3)
                            .map(|kx| {
                                let filter = if self.flipped {
                                    ci * self.cout + co
                                } else {
                                    co * self.cin + ci
                                };
                                magnitude(weight[filter * 9 + self.tap(ky, kx)], magnitudes)
                            })
                            .collect()
                    })
                    .collect();
                let t = sandwich_f64(&mx.g, &mx.g, &g, magnitudes);
                scatter(&mut u, &t, (self.cout, co), (self.cin, ci));
            }
        }
        u
    }

    /// The transformed input `v [elems, cin, t]` of `chunk` in f64, from
    /// the whole batch `x`; with `magnitudes`, of `|x|` through `|B|`.
    pub fn input_values(&self, chunk: Chunk, x: &[f32], magnitudes: bool) -> Vec<f64> {
        let mx = matrices(self.tile);
        let (m, a) = (self.tile, self.tile + 2);
        let t_len = self.tiles_of(chunk);
        let [p0, p1] = self.padding;
        let mut v = vec![0.0; self.elems() * self.cin * t_len];
        for ci in 0..self.cin {
            for ti in 0..t_len {
                let (nb, ty, tx) = self.tile_at(chunk, ti);
                let origin = (
                    (ty * m) as isize - p0 as isize,
                    (tx * m) as isize - p1 as isize,
                );
                let d = patch(
                    x,
                    [self.cin, self.h, self.w],
                    (nb, ci),
                    origin,
                    a,
                    magnitudes,
                );
                let t = sandwich_f64(&mx.bt, &mx.bt, &d, magnitudes);
                scatter(&mut v, &t, (self.cin, ci), (t_len, ti));
            }
        }
        v
    }

    /// The products `m [elems, cout, t]` of `chunk`: `u[z] v[z]` in f64.
    pub fn products(&self, chunk: Chunk, u: &[f64], v: &[f64]) -> Vec<f64> {
        let t_len = self.tiles_of(chunk);
        let (cin, cout) = (self.cin, self.cout);
        let mut out = vec![0.0; self.elems() * cout * t_len];
        for z in 0..self.elems() {
            for co in 0..cout {
                let row = &mut out[(z * cout + co) * t_len..][..t_len];
                for ci in 0..cin {
                    let a = u[(z * cout + co) * cin + ci];
                    let vs = &v[(z * cin + ci) * t_len..][..t_len];
                    for (o, &b) in row.iter_mut().zip(vs) {
                        *o += a * b;
                    }
                }
            }
        }
        out
    }

    /// Writes `chunk`'s outputs `A^T m A` (without the bias) into `y`, the
    /// whole batch's output; with `magnitudes`, through `|A|`.
    pub fn output_values(&self, chunk: Chunk, prod: &[f64], magnitudes: bool, y: &mut [f64]) {
        let mx = matrices(self.tile);
        let (m, a) = (self.tile, self.tile + 2);
        let t_len = self.tiles_of(chunk);
        for co in 0..self.cout {
            for ti in 0..t_len {
                let (nb, ty, tx) = self.tile_at(chunk, ti);
                let p = gather(prod, a, (self.cout, co), (t_len, ti));
                let out = sandwich_f64(&mx.at, &mx.at, &p, magnitudes);
                for (r, row) in out.iter().enumerate() {
                    for (c, &value) in row.iter().enumerate() {
                        let (oy, ox) = (ty * m + r, tx * m + c);
                        if oy < self.oh && ox < self.ow {
                            y[((nb * self.cout + co) * self.oh + oy) * self.ow + ox] = value;
                        }
                    }
                }
            }
        }
    }

    /// The convolution without its bias, computed on the CPU in f64 from
    /// `x [n, cin, h, w]` and the forward weight through the same
    /// transforms as the kernels: with `magnitudes`, every input and every
    /// coefficient is taken by its absolute value, giving the sum of the
    /// magnitudes of the terms each output adds (the scale of its rounding
    /// errors).
    pub fn reference(&self, x: &[f32], weight: &[f32], magnitudes: bool) -> Vec<f64> {
        let u = self.weight_values(weight, magnitudes);
        let mut y = vec![0.0f64; self.n * self.cout * self.oh * self.ow];
        for chunk in self.chunks() {
            let v = self.input_values(chunk, x, magnitudes);
            let prod = self.products(chunk, &u, &v);
            self.output_values(chunk, &prod, magnitudes, &mut y);
        }
        y
    }

    /// At most how many times the direct convolution's an output's
    /// magnitude sum is when every input and weight has the same size: the
    /// factor the transforms' coefficients put on rounding errors.
    pub fn magnification(&self) -> f64 {
        let a = self.tile + 2;
        let one = self.one_tile();
        let sums = one.reference(&vec![1.0; a * a], &[1.0; 9], true);
        sums.into_iter().fold(0.0, f64::max) / 9.0
    }

    /// [`Self::magnification`] of the weight gradient: its magnitude sums
    /// over the direct sum's, for one tile of equal inputs.
    pub fn weight_grad_magnification(&self) -> f64 {
        let one = self.one_tile();
        let (m, a) = (self.tile, self.tile + 2);
        let sums = one.weight_grad_reference(&vec![1.0; a * a], &vec![1.0; m * m], true);
        sums.into_iter().fold(0.0, f64::max) / (m * m) as f64
    }

    /// This geometry cut down to one image of one tile and one channel.
    fn one_tile(&self) -> Self {
        let a = self.tile + 2;
        Self {
            n: 1,
            cin: 1,
            cout: 1,
            h: a,
            w: a,
            padding: [0, 0],
            oh: self.tile,
            ow: self.tile,
            flipped: false,
            bias: false,
            temp_bytes: MAX_TEMP_BYTES,
            ..*self
        }
    }

    /// Roundings along the longest path to an output: the weight and input
    /// transforms', the product (1), the sum over the input channels
    /// (`cin`, in any order), the output transform's and the bias (1).
    /// Each operation is correctly rounded in WGSL, so an output is within
    /// `levels * 2^-24 * (its magnitude sum)` of the exact result, to first
    /// order.
    pub fn rounding_levels(&self) -> usize {
        let mx = matrices(self.tile);
        sandwich_levels(&mx.g, &mx.g)
            + sandwich_levels(&mx.bt, &mx.bt)
            + 1
            + self.cin
            + sandwich_levels(&mx.at, &mx.at)
            + 1
    }
}
